"""``nn.Module`` building blocks: the partition schedule of a layer and the attention modules.

:class:`PartitionSchedule` is *the* rule for which partitions an attention layer uses, shared by
the Hugging Face integration, the vision model and :class:`PoslshAttention`:

* training: fresh partitions for every step, seeded by ``(seed, step, layer)`` (the step travels
  with the inputs, so gradient-checkpoint recomputation sees the same masks; without a step, the
  schedule counts its own training calls);
* evaluation: fixed partitions per ``(eval_seed, layer)``, the same at every call;
* both cached on the device of the last call (no per-call host-to-device copy, no re-validation);
* under ``torch.compile`` the draw is one opaque custom op (``poslsh::schedule_draw``: host work on a
  seed hash that dynamo cannot trace), so a compiled module is one graph; the step may be a symbolic
  int (no recompilation per step), and a training call needs it (``step=``).

Seeds come from :func:`poslsh.seeding.stable_seed` of
``(tag + "train", seed, step, layer, num_heads, num_samples)`` in training and
``(tag + "eval", eval_seed, layer, num_heads, num_samples)`` in evaluation, with
``(sampler, group_size)`` appended for samplers other than i.i.d.; ``tag`` separates users that
must not share masks (default ``""``: the Hugging Face rule since the first release).

The modules share one vocabulary (:class:`HeadsAttention`): ``embed_dim`` (projections, optional),
``num_heads``, ``num_kv_heads`` (GQA), ``head_dim``, ``causal``, ``bias``, ``backend``; ``forward(x)``
maps ``[B, n, embed_dim]`` to ``[B, n, embed_dim]`` through the projections, ``attend(q, k, v)`` is the
attention alone (``[B, H, n, d]`` tensors), both with packed documents (``cu_seqlens`` /
``document_ids``). :class:`PoslshAttention` attends by positional LSH; :class:`AlibiAttention` by
exact ALiBi, whole or cut at per-head windows. See ``docs/model.md``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ._validation import check_has_values
from .alibi import alibi_slopes, as_per_head
from .attention import attend, poslsh_attention, poslsh_attention_nd
from .partitions import Partitions, check_sampler, sample_partitions
from .partitions_nd import PartitionsND, sample_partitions_nd
from .sampling import check_sigma, check_widths
from .seeding import stable_seed
from .window.kind import NO_WINDOW, AlibiWindow, make_window, windows_in_sigmas
from .window.theory import smallest_window

__all__ = ["PartitionSchedule", "HeadsAttention", "PoslshAttention", "AlibiAttention"]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class PartitionSchedule:
    """The partitions of one attention layer over training and evaluation (see the module docstring).

    Args:
        sigma: per-head bandwidths ``[H]`` (``1 / ALiBi slope``; :func:`poslsh.alibi_sigmas`), as the
            samplers take them.
        num_samples: ``s``, partitions per head.
        layer: the layer index (part of every seed).
        seed: the run seed (training partitions); eval_seed: the evaluation seed.
        sampler, group_size: as in :func:`poslsh.sample_partitions` (``"iid"``, ``"stratified"``,
            ``"grouped"``).
        dims: 1 for sequences (:class:`~poslsh.Partitions`), 2 for token grids
            (:class:`~poslsh.PartitionsND` boxes; every sampler, each axis on its own).
        tag: prefix of the seed keys (keeps two users of one seed apart).
    """

    def __init__(self, sigma, num_samples: int, *, layer: int = 0, seed: int = 0, eval_seed: int = 0,
                 sampler: str = "iid", group_size: Union[int, str, None] = None, dims: int = 1, tag: str = ""):
        self.sigma = check_sigma(sigma).detach().to("cpu", torch.float64)
        self.num_samples = _positive_int("num_samples", num_samples)
        check_sampler(sampler, group_size)
        if dims not in (1, 2):
            raise ValueError(f"dims must be 1 (sequences) or 2 (token grids), got {dims!r}")
        for name, value in (("layer", layer), ("seed", seed), ("eval_seed", eval_seed)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        self.layer, self.seed, self.eval_seed = layer, seed, eval_seed
        self.sampler, self.group_size, self.dims, self.tag = sampler, group_size, dims, str(tag)
        self.auto_step = -1           # training calls seen without an explicit step
        self._cache: dict = {}        # "train" / "eval" -> ((key, device), partitions)

    @property
    def num_heads(self) -> int:
        return self.sigma.numel()

    def key(self, training: bool, step: Optional[int] = None) -> tuple:
        """The parts of the seed of the partitions used in that phase (and step)."""
        H, s = self.num_heads, self.num_samples
        if training:
            key = (self.tag + "train", self.seed, int(step), self.layer, H, s)
        else:
            key = (self.tag + "eval", self.eval_seed, self.layer, H, s)
        if self.sampler != "iid":      # i.i.d. keeps its seeds (and so every earlier run's partitions)
            key += (self.sampler, self.group_size)
        return key

    def partitions(self, training: bool, step: Optional[int] = None, device=None) -> Union[Partitions, PartitionsND]:
        """The partitions to use now, on ``device`` (default CPU). In training without ``step`` the
        schedule's own call count stands in for it (not under ``torch.compile``: pass ``step``)."""
        if torch.compiler.is_compiling():
            return self._compiled(training, step, device)
        if training and step is None:
            self.auto_step += 1
            step = self.auto_step
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        key = self.key(training, step)
        device = torch.device("cpu") if device is None else torch.device(device)
        slot = "train" if training else "eval"
        hit = self._cache.get(slot)
        if hit is not None and hit[0] == (key, device):
            return hit[1]
        draw = sample_partitions if self.dims == 1 else sample_partitions_nd
        parts = draw(self.sigma, self.num_samples, seed=stable_seed(*key), sampler=self.sampler,
                     group_size=self.group_size).to(device)
        self._cache[slot] = ((key, device), parts)
        return parts

    def _compiled(self, training: bool, step, device) -> Union[Partitions, PartitionsND]:
        """:meth:`partitions` inside a ``torch.compile`` graph: the same draw (the same seed, so the same
        partitions) through :func:`schedule_draw`, uncached (a cache is state the graph cannot hold)."""
        if training and step is None:
            raise ValueError("step: under torch.compile a training PoslshAttention needs step= (the training step "
                             "seeds its partitions; the module's own call count is Python state a graph cannot hold)")
        if training and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        text = ":".join(map(str, self.key(training, 0)))
        if training:                   # the step's place in the seed's text (key: tag, seed, step, ...)
            head = ":".join(map(str, self.key(training, 0)[:2])) + ":"
            before, after = head, text[len(head) + 1:]
        else:
            before, after, step = text, "", -1
        device = torch.device("cpu") if device is None else torch.device(device)
        gs = "" if self.group_size is None else str(self.group_size)
        got = schedule_draw(self.sigma, self.num_samples, before, step, after, self.sampler, gs, self.dims, device)
        sigma, dist = self.sigma.to(device), check_widths(None, self.sampler)
        axes = tuple(Partitions.checked_elsewhere(got[i], got[i + 1], sigma, got[i + 2] if got[i + 2].numel() else None,
                                                  dist) for i in range(0, len(got), 3))
        return axes[0] if self.dims == 1 else PartitionsND(axes)

    def __repr__(self) -> str:
        return (f"PartitionSchedule(heads={self.num_heads}, samples={self.num_samples}, layer={self.layer}, "
                f"seed={self.seed}, eval_seed={self.eval_seed}, sampler={self.sampler!r}, dims={self.dims})")


@torch.library.custom_op("poslsh::schedule_draw", mutates_args=())
def schedule_draw(sigma: Tensor, num_samples: int, before: str, step: int, after: str, sampler: str,
                  group_size: str, dims: int, device: torch.device) -> List[Tensor]:
    """The tensors of a :class:`PartitionSchedule`'s partitions, drawn with the seed of the text
    ``before + step + after`` (``step < 0``: ``before + after``; the text of :meth:`PartitionSchedule.key`):
    per axis widths, offsets (float64 ``[H, s]``) and groups (int64 ``[H, s]``, ``[0]`` for i.i.d.), on
    ``device``. ``group_size``: ``""`` (None), ``"sqrt"`` or an int's digits. A custom op, so that
    ``torch.compile`` sees one node where the draw runs a CPU generator."""
    seed = stable_seed(before + (str(step) if step >= 0 else "") + after)
    size = None if group_size == "" else int(group_size) if group_size.isdigit() else group_size
    draw = sample_partitions if dims == 1 else sample_partitions_nd
    parts = draw(sigma, num_samples, seed=seed, sampler=sampler, group_size=size)
    none = torch.empty(0, dtype=torch.int64)
    return [t.to(device).contiguous().clone() for p in ((parts,) if dims == 1 else parts.axes)
            for t in (p.widths, p.offsets, none if p.groups is None else p.groups)]


@schedule_draw.register_fake
def _(sigma, num_samples, before, step, after, sampler, group_size, dims, device):
    H = sigma.shape[0]
    groups = (H, num_samples) if sampler != "iid" else (0,)
    return [sigma.new_empty(shape, dtype=dtype, device=device) for _ in range(dims)
            for shape, dtype in (((H, num_samples), torch.float64), ((H, num_samples), torch.float64),
                                 (groups, torch.int64))]


class HeadsAttention(nn.Module):
    """What the attention modules share: heads (GQA), optional projections, ``forward(x)`` and
    ``attend(q, k, v)`` (see the module docstring). A subclass defines :meth:`attend`.

    Args:
        embed_dim: model width; None: no projections (call :meth:`attend` with ``q, k, v``).
        num_heads: query heads ``Hq``; num_kv_heads: key/value heads (GQA, default ``Hq``).
        head_dim: per-head width (default ``embed_dim // num_heads``).
        causal: decoder attention (keys ``<= i``).
        bias: bias terms in the projections.
        backend: the op's backend (``"auto"``).
    """

    def __init__(self, embed_dim: Optional[int] = None, num_heads: int = 8, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, causal: bool = True, bias: bool = False, backend: str = "auto"):
        super().__init__()
        self.num_heads = _positive_int("num_heads", num_heads)
        self.num_kv_heads = _positive_int("num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self.embed_dim = None if embed_dim is None else _positive_int("embed_dim", embed_dim)
        if head_dim is None and embed_dim is not None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim ({embed_dim}) must be a multiple of num_heads ({num_heads}), "
                                 "or pass head_dim")
            head_dim = embed_dim // num_heads
        self.head_dim = None if head_dim is None else _positive_int("head_dim", head_dim)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        self.causal, self.backend = causal, backend
        if self.embed_dim is not None:
            hd, E = self.head_dim, self.embed_dim
            self.q_proj = nn.Linear(E, self.num_heads * hd, bias=bias)
            self.k_proj = nn.Linear(E, self.num_kv_heads * hd, bias=bias)
            self.v_proj = nn.Linear(E, self.num_kv_heads * hd, bias=bias)
            self.o_proj = nn.Linear(self.num_heads * hd, E, bias=bias)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:   # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: Tensor, **kwargs) -> Tensor:
        """``x [B, n, embed_dim]`` -> ``[B, n, embed_dim]``: project, :meth:`attend`, project back.
        ``kwargs``: those of :meth:`attend` (``step``, ``grid``, ``cu_seqlens``, ``document_ids``)."""
        if self.embed_dim is None:
            raise ValueError(f"a {type(self).__name__} without embed_dim has no projections: call .attend(q, k, v) "
                             "with [B, H, n, d] tensors")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be [batch, seqlen, {self.embed_dim}], got {tuple(x.shape)}")
        B, n, _ = x.shape
        q = self.q_proj(x).view(B, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = self.attend(q, k, v, **kwargs)
        return self.o_proj(out.transpose(1, 2).reshape(B, n, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}")


class PoslshAttention(HeadsAttention):
    """Multi-head attention whose only positional signal is positional LSH (an ALiBi estimate).

    Partitions follow :class:`PartitionSchedule`: fresh per (seed, step, layer) under ``train()``,
    fixed per (eval_seed, layer) under ``eval()``. ``torch.compile(module, fullgraph=True)`` traces one
    graph (the draw is one custom op; the step a symbolic int after one recompilation); in training it
    needs ``step=`` (the module's own call count is Python state a graph cannot hold: under fullgraph a
    call without it is refused). Arguments of :class:`HeadsAttention`, and:

    Args:
        num_samples: ``s``; sampler, group_size: see :func:`poslsh.sample_partitions`.
        slopes: per-head ALiBi slopes ``[Hq]`` the masks estimate, finite and ``> 0`` (default ALiBi's,
            :func:`poslsh.alibi_slopes` ``(Hq)``); the schedule draws at the bandwidths ``sigma = 1 / slopes``.
        dims: 1 (sequences) or 2 (token grids; pass ``grid=(h, w)`` to ``forward`` / ``attend``).
        layer, seed, eval_seed: the schedule's seeds (see :class:`PartitionSchedule`).
    """

    def __init__(self, embed_dim: Optional[int] = None, num_heads: int = 8, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, num_samples: int = 10, sampler: str = "iid",
                 group_size: Union[int, str, None] = None, slopes=None, causal: bool = True,
                 dims: int = 1, layer: int = 0, seed: int = 0, eval_seed: int = 0, bias: bool = False,
                 backend: str = "auto"):
        super().__init__(embed_dim, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, causal=causal,
                         bias=bias, backend=backend)
        m = alibi_slopes(self.num_heads) if slopes is None else \
            as_per_head(check_has_values(slopes, "slopes"), "slopes").detach().to(torch.float64)
        if not bool((torch.isfinite(m) & (m > 0)).all()):
            raise ValueError(f"slopes: positional LSH needs finite slopes > 0 (its blocks have mean width 2 / slope), "
                             f"got {m.tolist()}")
        self.dims = dims
        self.schedule = PartitionSchedule(1.0 / m, num_samples, layer=layer, seed=seed, eval_seed=eval_seed,
                                          sampler=sampler, group_size=group_size, dims=dims)
        if self.schedule.num_heads != self.num_heads:
            raise ValueError(f"slopes: got {self.schedule.num_heads} slopes for {self.num_heads} heads (num_heads)")

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", num_samples={self.schedule.num_samples}, "
                f"sampler={self.schedule.sampler!r}, dims={self.dims}")

    def partitions(self, step: Optional[int] = None, device=None):
        """The partitions the next call uses (training or evaluation, by ``self.training``)."""
        return self.schedule.partitions(self.training, step, device)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, step: Optional[int] = None,
               grid: Optional[Tuple[int, int]] = None, cu_seqlens: Optional[Tensor] = None,
               document_ids: Optional[Tensor] = None) -> Tensor:
        """Attention of ``q [B, Hq, n, d]`` over ``k, v [B, Hkv, n, d|dv]`` -> ``[B, Hq, n, dv]``. ``step``:
        the training step (partitions of that step); ``grid``: ``(height, width)`` for ``dims=2``;
        ``cu_seqlens`` / ``document_ids``: packed documents (:mod:`poslsh.documents`)."""
        parts = self.partitions(step, q.device)
        if self.dims == 2:
            if grid is None:
                raise ValueError("grid: a dims=2 PoslshAttention needs grid=(height, width) of the tokens")
            if cu_seqlens is not None or document_ids is not None:
                raise ValueError("cu_seqlens / document_ids: packed documents are for sequences (dims=1)")
            return poslsh_attention_nd(q, k, v, parts, grid=grid, causal=self.causal, backend=self.backend)
        if grid is not None:
            raise ValueError("grid: a dims=1 PoslshAttention attends sequences; build it with dims=2 for grids")
        return poslsh_attention(q, k, v, parts, causal=self.causal, backend=self.backend, cu_seqlens=cu_seqlens,
                                document_ids=document_ids)


class AlibiAttention(HeadsAttention):
    """Multi-head attention with exact ALiBi, whole or cut at a window per head (the library's
    recommendation for approximating ALiBi at long context, ``docs/frontier.md``). Arguments of
    :class:`HeadsAttention`, and:

    Args:
        slopes: per-head ALiBi slopes ``[Hq]`` (default ALiBi's, :func:`poslsh.alibi_slopes` ``(Hq)``).
        window: the windows (keys with ``|i - j| <= w_h`` attend): an int for every head, a sequence or
            an int tensor ``[Hq]``; ``None``: no cut. At most one of ``window``, ``window_sigmas`` and
            ``tol``; none of them: exact ALiBi (every key; ``O(n^2 d)`` time, ``O(n)`` memory).
        window_sigmas: ``c``: ``w_h = ceil(c sigma_h)`` (each dropped key weighs at most ``e^{-c}``
            relative to the query itself).
        tol, logit_range: the smallest windows whose dropped softmax mass is at most ``tol`` at any
            length when the logits spread at most ``logit_range`` (:func:`poslsh.theory.smallest_window`;
            :func:`poslsh.theory.logit_range` measures it on an input).
        dims: 1 (sequences; there is no N-D window op: ``PoslshAttention(dims=2)`` attends grids).
    """

    def __init__(self, embed_dim: Optional[int] = None, num_heads: int = 8, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, slopes=None, window=None,
                 window_sigmas: Optional[float] = None, tol=None, logit_range=None, causal: bool = True,
                 dims: int = 1, bias: bool = False, backend: str = "auto"):
        super().__init__(embed_dim, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, causal=causal,
                         bias=bias, backend=backend)
        if dims != 1:
            raise ValueError(f"dims: AlibiAttention attends sequences (dims=1), got {dims!r}; token grids: "
                             "PoslshAttention(dims=2) or poslsh.reference.alibi_attention_reference_nd")
        slopes = alibi_slopes(self.num_heads) if slopes is None else slopes
        given = [name for name, value in (("window", window), ("window_sigmas", window_sigmas), ("tol", tol))
                 if value is not None]
        if len(given) > 1:
            raise ValueError(f"AlibiAttention: pass at most one of window, window_sigmas and tol, got {given}")
        if logit_range is not None and tol is None:
            raise ValueError("logit_range: it sets the windows together with tol (the tolerance on the dropped mass)")
        m = make_window(slopes, 0, self.num_heads).slopes          # checked: finite, >= 0, one per head
        if window_sigmas is not None:
            window = windows_in_sigmas(window_sigmas, 1.0 / m)
        elif tol is not None:
            if logit_range is None:
                raise ValueError("tol: the windows of a tolerance need logit_range (a bound on the spread of "
                                 "the logits; poslsh.theory.logit_range measures it on an input)")
            window = smallest_window(tol, 1.0 / m, logit_range, causal=self.causal)
        self.window = make_window(m, window, self.num_heads)        # the layer's positional object
        self._on: dict = {}                                          # device -> the window there

    @property
    def exact(self) -> bool:
        """No window: exact ALiBi over every key."""
        return bool((self.window.window == NO_WINDOW).all())

    def extra_repr(self) -> str:
        windows = "exact" if self.exact else self.window.window.tolist()
        return super().extra_repr() + f", windows={windows}"

    def positional(self, device=None) -> AlibiWindow:
        """The layer's :class:`~poslsh.AlibiWindow` on ``device`` (cached: no copy per call)."""
        device = torch.device("cpu") if device is None else torch.device(device)
        if device not in self._on:
            self._on[device] = self.window.to(device)
        return self._on[device]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, step: Optional[int] = None,
               grid: Optional[Tuple[int, int]] = None, cu_seqlens: Optional[Tensor] = None,
               document_ids: Optional[Tensor] = None) -> Tensor:
        """Attention of ``q [B, Hq, n, d]`` over ``k, v [B, Hkv, n, d|dv]`` -> ``[B, Hq, n, dv]``;
        ``cu_seqlens`` / ``document_ids``: packed documents. ``step`` is accepted and ignored (the
        windows are fixed), so the module stands in for a :class:`PoslshAttention`."""
        if grid is not None:
            raise ValueError("grid: AlibiAttention attends sequences; token grids: PoslshAttention(dims=2)")
        return attend(q, k, v, self.positional(q.device), causal=self.causal, backend=self.backend,
                      cu_seqlens=cu_seqlens, document_ids=document_ids)
