"""Input checks shared by every attention entry point: bad input fails here,
with a message that names the problem, never deep inside torch."""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch
from torch import Tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class AttnShape(NamedTuple):
    batch: int
    q_heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    v_dim: int
    kv_len: int = -1     # keys per head (= seqlen for self-attention)

    @property
    def group(self) -> int:
        """Query heads per key/value head (GQA); query head h uses kv head h // group."""
        return self.q_heads // self.kv_heads


def check_has_values(t, name: str):
    """``t`` itself, unless it is a tensor on the meta device (a shape without values) where its values are
    needed: then one ValueError naming it (not torch's "Cannot copy out of meta tensor" from deep inside)."""
    if isinstance(t, Tensor) and t.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (a shape without values; its values are needed here): "
                         "pass it on the CPU or on q's device")
    return t


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, kv_cache: bool = False, any_lengths: bool = False) -> AttnShape:
    """Validate ``q [B, Hq, n, d]``, ``k [B, Hkv, nk, d]``, ``v [B, Hkv, nk, dv]``: ``nk = n``
    (self-attention), ``nk >= n`` with ``kv_cache``, any ``nk >= 1`` with ``any_lengths``
    (queries and keys at given positions). ``seqlen`` is the queries' length."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape [batch, heads, seqlen, head_dim], got {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, n, d = q.shape
    Bk, Hkv, nk, dk = k.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in [batch, heads, seqlen], got {tuple(k.shape)} and {tuple(v.shape)}")
    if Bk != B:
        raise ValueError(f"batch size of q ({B}) and k/v ({Bk}) differ")
    if nk != n and not (kv_cache and nk > n) and not (any_lengths and nk >= 1):
        raise ValueError(positions_needed(n, nk, "self-attention"))
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) and k ({dk}) differ")
    if n < 1:
        raise ValueError("seqlen must be >= 1")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for grouped-query attention")
    return AttnShape(B, Hq, Hkv, n, d, v.shape[-1], nk)


def check_scale(scale: Optional[float], head_dim: int) -> float:
    """The logit scale: ``1 / sqrt(head_dim)`` by default (1 for head_dim 0, where every
    logit is 0 anyway); a given scale must be a real number (not a string or a bool)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, Tensor) and scale.numel() == 1:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__} {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def positions_needed(nq: int, nk: int, where: str) -> str:
    """The one message of the positions rule: unequal query and key counts need explicit positions."""
    return (f"{where}: q has seqlen {nq} but k/v have {nk}: pass q_start (and k_start), the positions of the "
            f"first query and key; flash-attention's bottom-right alignment (the queries are the last {nq} keys) "
            f"is q_start = k_start + nk - nq")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def require_values(ok: Tensor, message: str) -> None:
    """A check on tensor values: a ValueError eagerly; inside torch.compile a runtime assert with the
    same message (a Python ``bool`` of a traced tensor would break the graph)."""
    if torch.compiler.is_compiling():
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)
