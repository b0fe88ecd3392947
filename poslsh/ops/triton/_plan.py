"""The plan the Triton kernels read, as plain torch (no triton): the reference the
plan kernel is tested against, the tile arithmetic of the cost model, and the
cache that keeps one plan per partitions.

Everything comes from the one definition of the block geometry in
:mod:`poslsh.partitions` (``block_labels``, ``block_bounds``), so the kernels see
exactly the blocks that the reference and the torch backend see.

* ``ids``  int32 ``[H, s, n]``: block label of every position (nondecreasing
  along the sequence; equal labels <=> same block).
* ``gran`` int32 ``[2, H, s, ceil(n / 16)]``: for every 16-position *granule*
  ``g``, the start of the block holding its first position ``16 g`` (row 0) and
  the end of the block holding its last position ``min(16 g + 15, n - 1)``
  (row 1). A tile of ``16 j`` positions reads its key range from these.
* ``order`` int32 ``[Hq + Hkv]``: query heads, then key/value heads, sorted by
  decreasing expected work (``sum_t min(w, n)``), so the longest programs start first.
* grouped partitions only: ``lat`` int32 ``[H, G, n]``, every position's index on its
  group's boundary lattice (:func:`lattice_index`), and ``ksz`` int32 ``[H, G]``, the
  group sizes: the label-compare path counts a group in one step from these.

On a GPU the plan is one Triton kernel (``_kernels._plan_kernel``), built once per
(partitions, n, GQA group) and kept in :data:`CACHE`; forward and backward share it.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ...partitions import Partitions, block_bounds, block_labels
from ...sampling import lattice_points

GRANULE = 16
# Bound on the float64 temporaries of block_ids: H * s * chunk elements.
_IDS_CHUNK_ELEMENTS = 1 << 23


class Plan(NamedTuple):
    ids: Tensor                   # int32 [H, s, n]
    gran: Tensor                  # int32 [2, H, s, ceil(n / 16)]
    order: Tensor                 # int32 [Hq + Hkv]
    lat: Optional[Tensor] = None  # int32 [H, G, n] (grouped partitions)
    ksz: Optional[Tensor] = None  # int32 [H, G]


# Lattice indices are differenced in int32 inside the kernels.
MAX_LATTICE_INDEX = 2 ** 30


def block_ids(widths: Tensor, offsets: Tensor, n: int, positions: Optional[Tensor] = None) -> Tensor:
    """int32 ``[H, s, n]`` block labels: :func:`poslsh.partitions.block_labels` in chunks
    (equal to ``Partitions.block_ids(n)`` wherever that fits in int32) of the positions
    ``0 .. n-1``, or of ``positions`` (int ``[n]``)."""
    H, S = widths.shape
    w, c = widths.to(torch.float64), offsets.to(torch.float64)
    out = torch.empty(H, S, n, dtype=torch.int32, device=widths.device)
    chunk = max(1, _IDS_CHUNK_ELEMENTS // max(1, H * S))
    for lo in range(0, n, chunk):
        u = torch.arange(lo, min(n, lo + chunk), dtype=torch.float64, device=widths.device)
        if positions is not None:
            u = positions[lo:lo + u.numel()].to(torch.float64)
        out[..., lo:lo + u.numel()] = block_labels(w, c, u).to(torch.int32)
    return out


def lattice_index(widths: Tensor, offsets: Tensor, groups: Tensor, n: int,
                  positions: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(lat int32 [H, G, n], ksz int32 [H, G])`` for grouped partitions: with the group's
    width ``b``, size ``k`` and lattice origin ``c`` (:meth:`Partitions.group_lattices`),
    ``lat[u] = floor((u - c) / (b / k)) - floor(-c / (b / k))`` (the lattice points in ``(0, u]``,
    :func:`poslsh.sampling.lattice_points`), so that
    ``#{lattice points in (i, j]} = lat[j] - lat[i]`` and the group's count is
    ``max(0, k - |lat[i] - lat[j]|)``: the arithmetic of :func:`poslsh.partitions.group_count`
    (bit for bit). Groups of width ``<= 1`` (one position per block) get ``k u``: any two
    positions are ``>= k`` apart. ``positions`` (int ``[n]``, default ``0 .. n-1``): the positions
    to index (packed documents: positions inside each document)."""
    width, origin, size = Partitions(widths, offsets, groups=groups).group_lattices()
    H, G = width.shape
    b, c, k = (x[..., None].to(torch.float64) for x in (width, origin, size))
    wide = b > 1.0
    spacing = torch.where(wide, b, torch.ones_like(b)) / k
    out = torch.empty(H, G, n, dtype=torch.int32, device=widths.device)
    chunk = max(1, _IDS_CHUNK_ELEMENTS // max(1, H * G))
    for lo in range(0, n, chunk):
        u = torch.arange(lo, min(n, lo + chunk), dtype=torch.float64, device=widths.device)
        if positions is not None:
            u = positions[lo:lo + u.numel()].to(torch.float64)
        idx = torch.where(wide, lattice_points(torch.zeros_like(u), u, c, spacing), (u * k).to(torch.int64))
        if int(idx.abs().max()) >= MAX_LATTICE_INDEX:
            raise ValueError(f"grouped partitions: lattice indices reach {int(idx.abs().max())} at n={n} "
                             f"(limit 2^30): use backend='torch' for this length")
        out[..., lo:lo + u.numel()] = idx.to(torch.int32)
    return out, size.to(torch.int32).contiguous()


def granule_bounds(widths: Tensor, offsets: Tensor, n: int) -> Tensor:
    """int32 ``[2, H, s, ceil(n / GRANULE)]``: block start of each granule's first position,
    block end of its last position."""
    dev = widths.device
    first = torch.arange(0, n, GRANULE, device=dev, dtype=torch.int64)
    last = torch.clamp(first + GRANULE - 1, max=n - 1)
    fs, _ = block_bounds(widths, offsets, n, first)
    _, le = block_bounds(widths, offsets, n, last)
    return torch.stack([fs, le]).to(torch.int32).contiguous()


def head_order(widths: Tensor, n: int, group: int) -> Tensor:
    """int32 ``[Hq + Hkv]``: query heads then kv heads, heaviest (widest blocks) first."""
    work = widths.to(torch.float64).clamp(max=float(n)).sum(1)
    q_order = torch.argsort(work, descending=True, stable=True)
    kv_work = work.view(-1, group).sum(1)
    kv_order = torch.argsort(kv_work, descending=True, stable=True)
    return torch.cat([q_order, kv_order]).to(torch.int32)


def plan(widths: Tensor, offsets: Tensor, n: int, group: int) -> Plan:
    """The plan in plain torch (the plan kernel's reference; ~100 small ops)."""
    return Plan(block_ids(widths, offsets, n), granule_bounds(widths, offsets, n), head_order(widths, n, group))


def row_strides(p: Plan) -> Tuple[int, int, int]:
    """Elements between the plans of two batch rows in ``ids``, ``gran`` and the compare path's
    labels (``lat``, else ``ids``); 0 when one plan serves every row."""
    if p.ids.dim() == 3 or p.ids.shape[0] == 1:
        return 0, 0, 0
    ids_bs = p.ids[0].numel()
    return ids_bs, p.gran[0, 0].numel(), ids_bs if p.lat is None else p.lat[0].numel()


def document_plan(widths: Tensor, offsets: Tensor, n: int, group: int, doc_start: Tensor, doc_end: Tensor,
                  groups: Optional[Tensor] = None) -> Plan:
    """The plan of packed documents (:class:`poslsh.documents.Documents` ``start`` / ``end``,
    int ``[B, n]``): the partition is laid over every document from its own start and cut at its
    end. One plan row per batch row (one for all when every row packs alike): ``ids`` int32
    ``[R, H, s, n]``, ``gran`` ``[2, R, H, s, ceil(n / 16)]``, ``lat`` ``[R, H, G, n]``.

    Labels are the local labels plus the number of blocks of the row's earlier documents, so
    they stay consecutive along the row (the kernels count a tile's blocks as a label range)
    and never equal across documents; block bounds are clipped to the document; lattice
    indices of consecutive documents are at least the group size apart (count 0 across)."""
    same = bool((doc_start == doc_start[:1]).all())
    starts, ends = (doc_start[:1], doc_end[:1]) if same else (doc_start, doc_end)
    H, S = widths.shape
    w64, c64 = widths.to(torch.float64), offsets.to(torch.float64)
    pos = torch.arange(n, device=widths.device)
    first = torch.arange(0, n, GRANULE, device=widths.device)
    last = torch.clamp(first + GRANULE - 1, max=n - 1)
    ids, gran, lats = [], [], []
    for st, en in zip(starts.to(widths.device), ends.to(widths.device)):
        local = pos - st
        head = local == 0
        doc = torch.cumsum(head.to(torch.int64), 0) - 1                        # document index of each token
        length = (en - st)[head]                                               # [D]
        lab = block_ids(widths, offsets, n, local).long()
        blocks = block_labels(w64, c64, (length - 1).to(torch.float64)).long() + 1      # [H, s, D]
        ids.append((lab + (torch.cumsum(blocks, -1) - blocks)[..., doc]).to(torch.int32))
        fs, _ = block_bounds(widths, offsets, n, local[first])
        _, le = block_bounds(widths, offsets, n, local[last])
        gran.append(torch.stack([st[first] + fs, st[last] + torch.minimum(le, (en - st)[last])]))
        if groups is not None:
            lat, ksz = lattice_index(widths, offsets, groups, n, local)
            span = lat[..., en[head] - 1].long() + ksz[..., None].long()              # [H, G, D]
            shifted = lat.long() + (torch.cumsum(span, -1) - span)[..., doc]
            if int(shifted.abs().max()) >= MAX_LATTICE_INDEX:
                raise ValueError(f"grouped partitions: packed lattice indices reach {int(shifted.abs().max())} "
                                 f"(limit 2^30): use backend='torch' for this length")
            lats.append(shifted.to(torch.int32))
    out = Plan(torch.stack(ids).contiguous(), torch.stack(gran, 1).to(torch.int32).contiguous(),
               head_order(widths, n, group))
    if groups is None:
        return out
    return out._replace(lat=torch.stack(lats).contiguous(), ksz=ksz.contiguous())


def tile_ranges(widths: Tensor, offsets: Tensor, n: int, tile: int, causal: bool,
                transpose: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """Per (head, program tile of ``tile`` positions): ``lo, hi`` (the union of the blocks
    touching the tile, as the kernels compute it, causal cut included: ``hi <= last + 1``
    for query tiles, ``lo >= first`` for key tiles with ``transpose``) and ``R`` (the
    number of (sample, block) pairs touching the tile; ``R <= R_MAX`` -> one-hot count)."""
    if tile % GRANULE:
        raise ValueError(f"tile must be a multiple of {GRANULE}")
    p0 = torch.arange(0, n, tile, device=widths.device)
    pl = torch.clamp(p0 + tile, max=n) - 1
    st, _ = block_bounds(widths, offsets, n, p0)
    _, en = block_bounds(widths, offsets, n, pl)
    lo, hi = st.amin(1), en.amax(1)                                    # [H, nP]
    if causal:
        if transpose:
            lo = torch.maximum(lo, p0)
        else:
            hi = torch.minimum(hi, pl + 1)
    u = torch.stack([p0, pl]).to(torch.float64)
    lab = block_labels(widths, offsets, u.reshape(-1)).view(*widths.shape, 2, -1)
    R = (lab[..., 1, :] - lab[..., 0, :] + 1).sum(1).to(torch.int64)
    return lo, hi, R


def visited_tiles(widths: Tensor, offsets: Tensor, n: int, block_m: int, block_n: int, causal: bool,
                  r_max: int = 32) -> Tuple[Tensor, Tensor]:
    """Key tiles the forward kernel visits per query head, ``(total [H], one_hot [H])`` (int64):
    all of them, and those of programs whose count is the one-hot MMA (``R <= r_max``).
    ``total * block_m * block_n`` is the number of score elements computed: the FLOP count
    behind the "TFLOP/s on visited tiles" of the benchmark."""
    lo, hi, R = tile_ranges(widths, offsets, n, block_m, causal)
    nt = (torch.clamp(hi - lo, min=0) + block_n - 1) // block_n
    return nt.sum(1), (nt * (R <= r_max)).sum(1)


# ------------------------------------------------------------------ the plan cache
def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:        # inference tensors have no version counter
        return -1


class PlanCache:
    """Plans by (widths, offsets, n, group, groups, documents): a hit needs the *same* tensor objects at the
    same version (an in-place change makes a new plan), entries die with their
    tensors, and at most ``size`` are kept (least recently used goes first; a plan
    holds ``~4.5 s`` bytes per (head, position)). Thread-safe: autograd runs the
    backward in another thread. ``builds`` counts misses (tests, launch counts)."""

    def __init__(self, size: int = 4):
        self.size = size
        self.builds = 0
        self._lock = threading.Lock()
        self._entries: "OrderedDict[tuple, tuple]" = OrderedDict()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, widths: Tensor, offsets: Tensor, n: int, group: int,
            build: Callable[[], Plan], groups: Optional[Tensor] = None, documents: Optional[Tensor] = None) -> Plan:
        key = (id(widths), id(offsets), _version(widths), _version(offsets), int(n), int(group),
               None if groups is None else (id(groups), _version(groups)),
               None if documents is None else (id(documents), _version(documents)))
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None and hit[0]() is widths and hit[1]() is offsets and hit[3] is groups \
                    and (hit[4] is None) == (documents is None) and (documents is None or hit[4]() is documents):
                self._entries.move_to_end(key)
                return hit[2]
        value = build()
        if self.size <= 0:
            return value
        ref_w = weakref.ref(widths, lambda _r, k=key: self._drop(k))
        ref_c = weakref.ref(offsets, lambda _r, k=key: self._drop(k))
        # a documents plan lives as long as its documents tensor (a new one every batch, kept
        # from a forward to its backward), not until the cache is full
        ref_d = None if documents is None else weakref.ref(documents, lambda _r, k=key: self._drop(k))
        with self._lock:
            self.builds += 1
            self._entries[key] = (ref_w, ref_c, value, groups, ref_d)
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value

    def _drop(self, key) -> None:
        with self._lock:
            self._entries.pop(key, None)


CACHE = PlanCache()


def cached(widths: Tensor, offsets: Tensor, n: int, group: int, build: Callable[[], Plan],
           cache: Optional[PlanCache] = None, groups: Optional[Tensor] = None,
           documents: Optional[Tensor] = None) -> Plan:
    return (CACHE if cache is None else cache).get(widths, offsets, n, group, build, groups, documents)
