"""The one metadata ``all_gather`` of a context-parallel call: every rank's shard and a
fingerprint of everything else that decides the result, checked identically on every rank.

Why every field: a rank that computes with another scale, window or partitions returns
rows of *another* attention, silently; a rank that will not run the backward leaves its
peers waiting in the exchange's backward. So the gathered row holds the shard (start,
length, ``seq_len``), ``causal``, the resolved ``scale``, the kind and a 64-bit BLAKE2b hash of
the positional object (partitions' widths and offsets; a window's slopes and windows), the
resolved backend of the local kernel, whether the call is differentiated, B, Hq, Hkv, d, dv
and the dtype. A disagreement raises the same one-line ValueError on every rank.

A bad input on one rank (any exception while checking it, not only ValueError / TypeError)
is caught before the ``all_gather``: that rank still joins it, flagged, and a second small
``all_gather`` carries its reason, so every rank raises one line naming the bad rank(s) and
why. What no check can catch is a rank that stops participating (it died, hangs, or never
makes the call): its peers wait in the collective until the process group's timeout, see
:mod:`poslsh.distributed`.
"""
from __future__ import annotations

import hashlib
import struct
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .._validation import check_qkv, check_scale
from ..ops import load_backends, registry
from ..positional import Positional, check_positional, kind_name
from .layout import ShardLayout, key_ranges

__all__ = ["positional_fingerprint", "partitions_fingerprint", "Agreed", "agree", "gather_layout", "FIELDS"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KINDS = ("sequence", "window")      # the kinds a sequence is sharded with (their index is gathered)
# Per-rank integers of the metadata all_gather (their order in the gathered table).
FIELDS = ("ok", "message_bytes", "start", "length", "seq_len", "causal", "grad", "kind", "fingerprint", "scale",
          "backend", "batch", "q_heads", "kv_heads", "head_dim", "v_dim", "dtype")
_COL = {name: i for i, name in enumerate(FIELDS)}
_MAX_MESSAGE = 400        # bytes of a bad rank's reason that travel


def _hash64(*chunks: bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    for c in chunks:
        h.update(c)
    return int.from_bytes(h.digest(), "little", signed=True)


def positional_fingerprint(positional: Positional) -> int:
    """A signed 64-bit hash of a positional object, bit for bit: its kind and tensors
    (:meth:`~poslsh.positional.Positional.fingerprint`)."""
    return check_positional(positional).fingerprint()


partitions_fingerprint = positional_fingerprint       # the name of earlier releases


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


class Agreed(NamedTuple):
    """A checked call: the layout, the resolved scale and the backend of the local kernel."""

    layout: ShardLayout
    scale: float
    backend: str


def _meta_device(q, group) -> torch.device:
    if isinstance(q, Tensor):
        return q.device
    if dist.get_backend(group) == "nccl":      # NCCL moves CUDA tensors only
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(local: Tensor, world: int, group) -> List[Tensor]:
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local, group=group)
    return parts


def _reason(error: BaseException) -> bytes:
    text = " ".join(f"{type(error).__name__}: {error}".split())          # one line
    return text.encode("utf-8")[:_MAX_MESSAGE]


def _ranks(rs: List[int]) -> str:
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}"


def _local_row(q, k, v, positional, causal, scale, shard_start, seq_len, backend) -> Tuple[List[int], float, str]:
    """This rank's metadata row, the resolved scale and backend; raises on bad input."""
    shape = check_qkv(q, k, v)
    check_positional(positional, op=_KINDS)
    positional.check_heads(shape.q_heads)
    scale = check_scale(scale, shape.head_dim)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    for name, x in (("shard_start", shard_start), ("seq_len", seq_len)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 0):
            raise ValueError(f"{name} must be an int >= 0 or None, got {x!r}")
    load_backends()
    # The local kernel's backend is resolved here, so a rank that cannot run it fails before any peer waits.
    name = registry.resolve(backend, positional.op, q, {"spans"}).name
    grad = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
    row = dict(ok=1, message_bytes=0, start=-1 if shard_start is None else shard_start, length=shape.seqlen,
               seq_len=-1 if seq_len is None else seq_len, causal=int(causal), grad=int(grad),
               kind=_KINDS.index(positional.op), fingerprint=positional.fingerprint(),
               scale=_float_bits(scale), backend=_hash64(name.encode()), batch=shape.batch, q_heads=shape.q_heads,
               kv_heads=shape.kv_heads, head_dim=shape.head_dim, v_dim=shape.v_dim, dtype=_DTYPES.index(q.dtype))
    return [row[f] for f in FIELDS], scale, name


def agree(q: Tensor, k: Tensor, v: Tensor, positional: Positional, *, causal: bool, scale: Optional[float] = None,
          shard_start: Optional[int] = None, seq_len: Optional[int] = None, group=None,
          backend: str = "auto") -> Agreed:
    """Gather every rank's metadata and check it identically everywhere (see the module
    docstring); every rank's key range from the (verified identical) positional object."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context-parallel attention needs an initialised torch.distributed process group")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("context-parallel attention: this process is not a member of the given group")
    error, reason, mine = None, b"", [0] * len(FIELDS)
    try:
        mine, scale, name = _local_row(q, k, v, positional, causal, scale, shard_start, seq_len, backend)
    except Exception as e:      # anything: the peers must not be left waiting in the all_gather
        error, reason = e, _reason(e)
        mine[_COL["message_bytes"]] = len(reason)
    device = _meta_device(q, group)
    table = [t.tolist() for t in _gather(torch.tensor(mine, dtype=torch.int64, device=device), world, group)]
    bad = [r for r, row in enumerate(table) if row[_COL["ok"]] != 1]
    if bad:
        size = max(1, max(table[r][_COL["message_bytes"]] for r in bad))
        local = torch.zeros(size, dtype=torch.uint8, device=device)
        local[:len(reason)] = torch.tensor(list(reason), dtype=torch.uint8)
        texts = [bytes(t.tolist()[:table[r][_COL["message_bytes"]]]).decode("utf-8", "ignore")
                 for r, t in enumerate(_gather(local, world, group))]
        by_reason = {}
        for r in bad:
            by_reason.setdefault(texts[r], []).append(r)
        why = "; ".join(f"{_ranks(rs)}: {text}" for text, rs in by_reason.items())
        if len(by_reason) > 1:
            why = f"{_ranks(bad)}: {why}"
        raise ValueError(f"context-parallel attention: bad input on {why} (every rank raises this error)") from error
    starts, lengths, n = check_table(table)
    lo, hi = key_ranges(positional, n, starts, lengths, causal)
    return Agreed(ShardLayout(rank, n, tuple(starts), tuple(lengths), tuple(lo), tuple(hi), causal), scale, name)


def gather_layout(q: Tensor, k: Tensor, v: Tensor, positional: Positional, *, causal: bool,
                  scale: Optional[float] = None, shard_start: Optional[int] = None, seq_len: Optional[int] = None,
                  group=None, backend: str = "auto") -> ShardLayout:
    """The checked :class:`ShardLayout` of a call (:func:`agree`). ``q [B, Hq, L, d]``,
    ``k/v [B, Hkv, L, d|dv]`` are this rank's shard (only their shapes, dtype, device and
    ``requires_grad`` are used); collective: every rank of ``group`` calls it."""
    return agree(q, k, v, positional, causal=causal, scale=scale, shard_start=shard_start, seq_len=seq_len,
                 group=group, backend=backend).layout


# ------------------------------------------------------------------ the checks
def _groups(values) -> List[List[int]]:
    out = {}
    for r, x in enumerate(values):
        out.setdefault(x, []).append(r)
    return list(out.values())


def _disagree(what: str, values, advice: str = "every rank must pass the same") -> ValueError:
    return ValueError(f"context-parallel ranks disagree on {what}: {list(values)} (rank by rank); {advice}")


def check_table(table: List[List[int]]) -> Tuple[List[int], List[int], int]:
    """Validate the gathered metadata (identically on every rank); returns starts, lengths, seq_len."""
    col = {name: [row[i] for row in table] for i, name in enumerate(FIELDS)}
    for name in ("causal", "batch", "q_heads", "kv_heads", "head_dim", "v_dim"):
        if len(set(col[name])) > 1:
            raise _disagree(name, [bool(x) for x in col[name]] if name == "causal" else col[name])
    if len(set(col["dtype"])) > 1:
        raise _disagree("dtype", [str(_DTYPES[x]) for x in col["dtype"]])
    if len(set(col["grad"])) > 1:
        raise _disagree("whether the call is differentiated (grad mode on and k or v requiring grad)",
                        [bool(x) for x in col["grad"]], "the backward exchange is collective: every rank must "
                        "differentiate the call, or none")
    if len(set(col["kind"])) > 1:
        raise _disagree("the positional object", [kind_name(_KINDS[x]).split(".")[-1] for x in col["kind"]])
    if len(set(col["fingerprint"])) > 1:
        what = "ALiBi windows (slopes, windows)" if col["kind"][0] else "partitions"
        raise ValueError(f"context-parallel {what} differ across ranks (fingerprints split the ranks into "
                         f"{_groups(col['fingerprint'])}); every rank must use the same {what}"
                         + ("" if col["kind"][0] else " (same seed, step, layer)"))
    if len(set(col["scale"])) > 1:
        raise _disagree("scale", [_bits_float(x) for x in col["scale"]])
    if len(set(col["backend"])) > 1:
        raise ValueError(f"context-parallel ranks run the local kernel on different backends (ranks grouped by "
                         f"backend: {_groups(col['backend'])}); pass the same backend on every rank")
    explicit = [x >= 0 for x in col["start"]]
    if len(set(explicit)) > 1:
        raise ValueError(f"context-parallel shard_start given on ranks {[r for r, e in enumerate(explicit) if e]} "
                         f"only: pass it on every rank or on none")
    lengths = col["length"]
    starts = col["start"] if explicit[0] else [sum(lengths[:r]) for r in range(len(lengths))]
    n = sum(lengths)
    given = {x for x in col["seq_len"] if x >= 0}
    if len(given) > 1 or (given and given != {n}) or len(set(x >= 0 for x in col["seq_len"])) > 1:
        raise ValueError(f"context-parallel seq_len {col['seq_len']} (rank by rank) must be the same on every rank "
                         f"and equal the shards' total length {n}")
    shown = " ".join(f"[{a}, {a + m})" for a, m in zip(starts, lengths))
    for r, (a, m) in enumerate(zip(starts, lengths)):
        expected = starts[r - 1] + lengths[r - 1] if r else 0
        if a != expected:
            where = f"rank {r - 1}'s shard ends at {expected}" if r else "the first shard must start at 0"
            raise ValueError(f"context-parallel shards must be contiguous and ordered by rank, covering [0, {n}): "
                             f"rank {r} holds [{a}, {a + m}) but {where} (shards rank by rank: {shown})")
    return starts, lengths, n
