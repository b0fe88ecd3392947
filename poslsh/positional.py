"""The positional protocol: one small interface every positional kind implements.

A *positional kind* decides which keys a query sees and with what weight. Three exist:

* :class:`~poslsh.partitions.Partitions` (positional LSH, fixed blocks): the keys in the blocks
  holding the query, weighted by how many samples share them (op ``"sequence"``);
* :class:`~poslsh.window.kind.AlibiWindow` (exact ALiBi cut at per-head windows): keys within
  ``w_h``, weighted ``e^{-m_h |i - j|}`` (op ``"window"``);
* :class:`~poslsh.partitions_nd.PartitionsND` (random boxes over token coordinates, op ``"nd"``).

Every kind knows itself, as every bias of xformers' ``attn_bias`` does and as FlexAttention's
``BlockMask`` is one object: the code that decodes, shards, caches or checks a call asks the
object (its methods below) instead of asking which kind it is. What a kind answers:

=====================  ==============================================================================
``op``                 the registry op that serves it (:mod:`poslsh.ops.registry`); attending with it is
                       :func:`poslsh.attend` ``(q, k, v, positional, ...)``, which dispatches to that op
``num_heads``          query heads; ``check_heads(n)`` raises naming the mismatch, ``check_layout(n, grid)``
                       checks the call's token layout (a call's validation)
``device``, ``to(d)``  where its tensors live; ``to`` moves checked values without checking again
``for_compute(dt)``    itself as a backend computing in ``dt`` takes it: values ``dt`` cannot hold replaced
                       by ones that give the same attention (the dispatcher asks, for every backend)
``tensors()``          the tensors that define it (what custom ops and kernels take), in a fixed order
``fingerprint()``      a 64-bit hash of its kind and tensors, bit for bit (context parallelism)
``same_as(other)``     the same kind with bit-identical tensors
``reach(pos, n)``      per head, the keys ``[first, end)`` a query at each position can see (int64 ``[H, P]``)
``first_needed(pos)``  the first key a causal query at each position can see (the eviction rule)
``cache_bound()``      most keys a causal stream keeps after a step (per head too)
``dense_bias(qp, kp)`` the float64 log-weights ``[H, P, Q]`` between positions, ``-inf`` where unseen: the
                       dense oracle (:mod:`poslsh.reference`) and the dense fallbacks use it
=====================  ==============================================================================

Positions are absolute integer positions in a sequence (``[P]``); for the ``"nd"`` kind, token
coordinates ``[P, D]`` (which have no 1-D reach: decoding and context parallelism serve sequences).
"""
from __future__ import annotations

import hashlib
from typing import ClassVar, Dict, List, Tuple, Union

import torch
from torch import Tensor

__all__ = ["Positional", "check_positional", "kind_name", "as_positions"]

_KINDS: Dict[str, type] = {}    # op -> the kind serving it (filled by the kinds' class definitions)


class Positional:
    """Base of the positional kinds (see the module docstring). A kind sets ``op`` and ``heads_are``
    (how :meth:`check_heads` names its heads) and defines ``num_heads``, ``device``, ``to``,
    ``tensors``, ``dense_bias`` and, for sequences, ``reach`` and ``cache_bound``."""

    op: ClassVar[str] = ""
    heads_are: ClassVar[str] = "the positional object has"
    public_name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.op:
            _KINDS[cls.op] = cls

    # ------------------------------------------------------------ defined by every kind
    @property
    def num_heads(self) -> int:                              # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def device(self) -> torch.device:                        # pragma: no cover - abstract
        raise NotImplementedError

    def to(self, device) -> "Positional":                    # pragma: no cover - abstract
        raise NotImplementedError

    def tensors(self) -> Tuple[Tensor, ...]:                 # pragma: no cover - abstract
        raise NotImplementedError

    def dense_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:   # pragma: no cover - abstract
        raise NotImplementedError

    def for_compute(self, dtype: torch.dtype) -> "Positional":
        """The object a backend computing in ``dtype`` (float32 or float64) attends with: the same
        attention, every value held by ``dtype``. Most kinds hold nothing ``dtype`` cannot: itself."""
        return self

    def reach(self, positions: Tensor, seq_len: int) -> Tuple[Tensor, Tensor]:
        raise TypeError(f"{type(self).__name__} has no reach along a sequence: decoding and context parallelism "
                        "serve the sequence and window kinds")

    def cache_bound(self, *, per_head: bool = False) -> Union[int, List[int]]:
        raise TypeError(f"{type(self).__name__} has no decoding cache: decoding serves the sequence and window kinds")

    # ------------------------------------------------------------ shared by every kind
    def check_heads(self, num_heads: int) -> None:
        """Raise unless the object has one entry per query head of the call."""
        if self.num_heads != num_heads:
            hint = (f" (a number as sigma or slopes is one head's value; {num_heads} heads need one each, e.g. "
                    f"poslsh.alibi_sigmas({num_heads}))" if self.num_heads == 1 else "")
            raise ValueError(f"{self.heads_are} {self.num_heads} heads but q has {num_heads} query heads{hint}")

    def check_layout(self, seq_len: int, grid=None):
        """The call's token layout: a sequence (``grid`` None, returned as is) unless the kind says otherwise."""
        if grid is not None:
            raise ValueError(f"grid: {type(self).__name__} attends sequences and takes no grid (a PartitionsND "
                             "attends token grids)")
        return None

    def first_needed(self, positions, *, per_head: bool = False) -> Tensor:
        """The first key a causal query at each of ``positions`` (int ``[P]``, ``>= 0``) can see, over all
        heads (int64 ``[P]``; ``per_head``: ``[H, P]``), on the CPU. No query at ``p`` or later sees a key
        before it (blocks and windows only move forward along the sequence)."""
        pos = as_positions(positions)
        if pos.numel() == 0:
            return pos.reshape(self.num_heads, 0) if per_head else pos
        first = self.reach(pos.to(self.device), int(pos.max()) + 1)[0].cpu()
        return first if per_head else first.amin(0)

    def fingerprint(self) -> int:
        """A signed 64-bit hash of the kind and its tensors, bit for bit."""
        h = hashlib.blake2b(digest_size=8)
        h.update(self.op.encode())
        for t in self.tensors():
            t = t.detach().to("cpu", torch.float64 if t.dtype.is_floating_point else torch.int64).reshape(-1)
            h.update(repr(tuple(t.shape)).encode())
            h.update(bytes(t.contiguous().view(torch.uint8).tolist()))
        return int.from_bytes(h.digest(), "little", signed=True)

    def same_as(self, other) -> bool:
        """The same kind with bit-identical tensors (on any devices)."""
        if self is other:
            return True
        if type(other) is not type(self) or other.num_heads != self.num_heads:
            return False
        mine, theirs = self.tensors(), other.tensors()
        return len(mine) == len(theirs) and all(a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
                                                for a, b in zip(mine, theirs))


def as_positions(positions) -> Tensor:
    positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).cpu()
    if positions.numel() and bool((positions < 0).any()):
        raise ValueError(f"positions must be >= 0, got min {int(positions.min())}")
    return positions


def kind_name(op: str) -> str:
    """The public name of the kind served by ``op`` (e.g. ``"poslsh.Partitions"``)."""
    return _KINDS[op].public_name if op in _KINDS else op


def check_positional(positional, name: str = "positional", op: Union[str, Tuple[str, ...], None] = None) -> Positional:
    """``positional`` itself if it is a positional kind (served by ``op``, one op or a tuple of them,
    when given), else a TypeError naming ``name`` and the kinds it may be."""
    ops = tuple(_KINDS) if op is None else (op,) if isinstance(op, str) else tuple(op)
    if not isinstance(positional, Positional) or positional.op not in ops:
        names = " or a ".join(kind_name(o) for o in ops)
        raise TypeError(f"{name} must be a {names}, got {type(positional).__name__}")
    return positional
