"""An encoder layer's ALiBi attention over the unpadded tokens: exact, per-head windows, or
certified windows, through :func:`poslsh.windowed_alibi_attention` (non-causal, the symmetric bias
``-m_h |i - j|``).

The slopes are the original's: the ALiBi rule's slopes rounded to float32 (the models build them
with ``torch.Tensor(slopes)``), given to the op as float64 values. Certified windows
(``window="certified"``, ``tol``): per call the logit spread bound of
:func:`poslsh.theory.logit_range_bound` (Cauchy-Schwarz on this call's
q and k) and :func:`poslsh.theory.smallest_window` with ``causal=False`` and ``n`` the call's
longest row: every query's dropped softmax mass is ``<= tol`` (a guarantee for that call).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ....alibi import alibi_slopes
from ....window.kind import NO_WINDOW, AlibiWindow, make_window
from ....window.op import windowed_alibi_attention
from ....window.theory import logit_range_bound, smallest_window
from ..dense import chunked_attention
from .rounding import f32_table_correction, inexact_heads
from .tokens import Tokens

__all__ = ["EncoderAlibi", "check_window"]


def check_window(window, tol) -> None:
    """One-line errors for a ``window`` / ``tol`` pair that means nothing."""
    if isinstance(window, str):
        if window != "certified":
            raise ValueError(f"window: None (exact), an int or [H] windows, or 'certified'; got {window!r}")
        if tol is None or isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not 0 < tol < 1:
            raise ValueError(f"tol: window='certified' needs tol in (0, 1) (the dropped softmax mass per query), "
                             f"got {tol!r}")
    elif tol is not None:
        raise TypeError("tol: only with window='certified' (fixed windows and exact ALiBi take no tolerance)")


@dataclass
class EncoderAlibi:
    """One layer's attention state: ``slopes`` float64 ``[H]`` (float32 values), ``scale``, ``mode``
    (``"exact"``, ``"window"``, ``"certified"``), the fixed ``positional`` (None when certified),
    ``tol``, ``backend``; ``last``: the widest window per head of the last forward (and, certified,
    the logit-range bounds)."""

    slopes: Tensor
    scale: float
    mode: str = "exact"
    positional: Optional[AlibiWindow] = None
    tol: Optional[float] = None
    backend: str = "auto"
    last: dict = field(default_factory=dict)

    @classmethod
    def build(cls, num_heads: int, head_dim: int, *, window=None, tol=None, backend: str = "auto") -> "EncoderAlibi":
        check_window(window, tol)
        slopes = alibi_slopes(num_heads).to(torch.float32).to(torch.float64)
        scale = head_dim ** -0.5
        if isinstance(window, str):
            return cls(slopes, scale, "certified", None, float(tol), backend)
        if window is None:
            return cls(slopes, scale, "exact", make_window(slopes, NO_WINDOW), None, backend)
        return cls(slopes, scale, "window", make_window(slopes, window), None, backend)

    def _positional(self, q: Tensor, k: Tensor, longest: int) -> AlibiWindow:
        if self.positional is not None:
            if self.positional.device != q.device:
                self.positional = self.positional.to(q.device)
            return self.positional
        R = logit_range_bound(q, k, self.scale)
        w = smallest_window(self.tol, 1.0 / self.slopes, R.cpu(), causal=False, n=max(longest, 1))
        self.last["logit_range"] = [max(a, b) for a, b in zip(self.last.get("logit_range", [0.0] * len(w)), R.tolist())]
        self.last["window"] = [max(a, b) for a, b in zip(self.last.get("window", [0] * len(w)), w.tolist())]
        return make_window(self.slopes.to(q.device), w.to(q.device))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, tokens: Tokens, dropout: float = 0.0) -> Tensor:
        """``q, k, v [nnz, H, d]`` (the unpadded tokens) -> ``[nnz, H, d]``: every row attends to its
        own tokens only, per :attr:`Tokens.calls`. ``dropout > 0`` (training with the checkpoint's
        ``attention_probs_dropout_prob``): dropout on the probabilities, as the original's torch path,
        exact and dense per chunk of queries of each row (:func:`..dense.chunked_attention`)."""
        self.last = {}
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))                 # [1, H, nnz, d]
        correct = (q.dtype == torch.float64 and self.mode == "exact" and bool(inexact_heads(self.slopes).any()))
        outs = []
        for first, end, cu in tokens.calls:
            qc, kc, vc = qh[:, :, first:end], kh[:, :, first:end], vh[:, :, first:end]
            longest = end - first if cu is None else int(cu.diff().max())
            positional = self._positional(qc, kc, longest)
            if dropout > 0:
                outs.append(self._dropped(qc, kc, vc, positional, cu, dropout))
                continue
            got = windowed_alibi_attention(qc, kc, vc, positional.slopes, window=positional.window, causal=False,
                                           scale=self.scale, backend=self.backend, cu_seqlens=cu, return_lse=correct)
            if correct:
                got = f32_table_correction(qc, kc, vc, *got, self.slopes, self.scale, cu)
            outs.append(got)
        if self.mode == "window":
            self.last["window"] = self.positional.window.tolist()
        if not outs:
            return q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
        return out[0].transpose(0, 1)

    def _dropped(self, q: Tensor, k: Tensor, v: Tensor, positional: AlibiWindow, cu: Optional[Tensor],
                 p: float) -> Tensor:
        """One call's rows with dropout ``p`` on the probabilities: each row (document) dense per query chunk."""
        bounds = [0, q.shape[2]] if cu is None else cu.tolist()
        parts = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            pos = torch.arange(b - a, device=q.device)
            parts.append(chunked_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], positional, self.scale, pos,
                                           pos, p=p))
        return torch.cat(parts, 2)
