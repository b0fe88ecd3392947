"""The pieces every kernel is built from: reductions, tile loads, the program's tile, the matrices a
program streams, the online-softmax step, the forward's row statistics and the backward's
recomputed probabilities.

Only builtins and functions decorated in this package are used: Triton's own @jit helpers
(``tl.max``, ``tl.sum``, ``tl.zeros``, ``tl.cdiv``) are decorated once, when triton is imported,
for one mode only, which would pin the package to that mode. Reductions call the builtin
``tl.reduce`` with Triton's combine functions (what ``tl.max`` / ``tl.sum`` do; the interpreter
recognises them and reduces with numpy).

Structs are ``NamedTuple`` s of runtime values (pointers, scalars, tensors): built once, read by
field name, so that no helper takes a long list of positional arguments. Compile-time values
(``tl.constexpr``) cannot travel inside them and are passed by keyword.
"""
from typing import NamedTuple

import triton
import triton.language as tl

MIN = tl.standard._elementwise_min
MAX = tl.standard._elementwise_max
SUM = tl.standard._sum_combine
# Runtime integer arguments whose value-based specialisation (== 1, % 16 == 0) buys nothing: loop
# bounds, head counts, the autotuning key. One compile serves all values.
NO_SPEC = ["S", "NC", "N_KEY", "G", "B", "Hq", "Hkv", "n_gran", "gran_stride", "ids_bs", "gran_bs", "lat_bs"]


class Tile(NamedTuple):
    """The tile a program owns: rows ``p0 .. plast`` (``offs = p0 + [0, P)``, rows ``>= n`` masked)
    of batch row ``b`` of head ``h`` (a query head; a kv head in the dk/dv kernels)."""
    b: object
    h: object
    p0: object
    plast: object
    offs: object


class Rows(NamedTuple):
    """A ``[n, D]`` matrix of one (batch, head) that a program streams tiles of: a TMA tensor
    descriptor (``src``) or its base pointer, and the row stride."""
    src: object
    stride: object


@triton.jit
def program_tile(pid, n, B, H, ORDER, ORDER_OFF, P: tl.constexpr):
    """The :class:`Tile` of program ``pid`` on the 1-D grid of (tile, batch, head): heads in the
    order ``ORDER[ORDER_OFF:]`` (the heaviest first), all tiles of a (batch, head) in a row."""
    n_tiles = (n + P - 1) // P
    tile = pid % n_tiles
    rest = pid // n_tiles
    p0 = tile * P
    return Tile(rest % B, tl.load(ORDER + ORDER_OFF + rest // B), p0, tl.minimum(p0 + P, n) - 1,
                p0 + tl.arange(0, P))


@triton.jit
def head_base(base, b, h, stride_b, stride_h):
    """Pointer to the ``[n, D]`` matrix of batch row ``b``, head ``h`` (int64 offsets)."""
    return base + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h


@triton.jit
def rows_of(base, stride, n, D: tl.constexpr, R: tl.constexpr, HD: tl.constexpr, USE_TMA: tl.constexpr):
    """The :class:`Rows` of the ``[n, D]`` matrix at ``base``, streamed in tiles of ``R`` rows: one
    TMA descriptor per program when ``USE_TMA`` (it pads rows past ``n`` and columns past ``D``
    with zeros and costs no per-element address registers), else the pointer."""
    if USE_TMA:
        src = tl.make_tensor_descriptor(base, shape=[n, D], strides=[stride, 1], block_shape=[R, HD])
    else:
        src = base
    return Rows(src, stride)


@triton.jit
def load_tile(base, offs_r, stride_r, n, D: tl.constexpr, HD: tl.constexpr):
    """Rows ``offs_r`` of the ``[n, D]`` matrix at ``base``, zero-padded to ``HD`` columns."""
    offs_d = tl.arange(0, HD)
    ptrs = base + offs_r.to(tl.int64)[:, None] * stride_r + offs_d[None, :]
    if HD != D:
        x = tl.load(ptrs, mask=(offs_r < n)[:, None] & (offs_d < D)[None, :], other=0.0)
    else:
        x = tl.load(ptrs, mask=(offs_r < n)[:, None], other=0.0)
    return x


@triton.jit
def stream_tile(m, r0, n, D: tl.constexpr, R: tl.constexpr, HD: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows ``r0 + [0, R)`` of the :class:`Rows` ``m``, zero-padded to ``[R, HD]``."""
    if USE_TMA:
        x = m.src.load([r0, 0])
    else:
        x = load_tile(m.src, r0 + tl.arange(0, R), m.stride, n, D, HD)
    return x


@triton.jit
def store_tile(base, x, offs_r, stride_r, n, D: tl.constexpr, HD: tl.constexpr):
    """Stores ``x [len(offs_r), HD]`` (cast to ``base``'s dtype) into rows ``offs_r < n``, columns ``< D``."""
    offs_d = tl.arange(0, HD)
    ptrs = base + offs_r.to(tl.int64)[:, None] * stride_r + offs_d[None, :]
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=(offs_r < n)[:, None] & (offs_d < D)[None, :])


@triton.jit
def softmax_step(acc, l_i, m_i, x, scale, keep, weight):
    """One online-softmax step over a streamed tile, in base 2: the tile's weights
    ``p = 2^(x scale - m) weight`` where ``keep`` (0 elsewhere), with ``m`` the running row max of
    ``x scale``; ``acc`` and ``l`` rescaled to the new max. Returns ``p, acc, l, m``.

    The exponent is one fma: one rounding, of a small number, whatever the magnitude of the logits
    (the sequence op passes ``q.k`` and the scale; the window op its biased logits and 1, which
    it rounds once, the same way in the backward). :func:`recomputed_p` is its backward twin."""
    m_new = tl.maximum(m_i, tl.reduce(tl.where(keep, x * scale, float("-inf")), 1, MAX))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.where(keep, tl.exp2(tl.fma(x, scale, -m_safe[:, None])) * weight, 0.0)
    alpha = tl.exp2(m_i - m_safe)
    return p, acc * alpha[:, None], l_i * alpha + tl.reduce(p, 1, SUM), m_new


@triton.jit
def recomputed_p(x, scale, keep, weight, lse, lse_lo):
    """The backward's weights ``2^(fma(x, scale, -lse) - lse_lo) weight`` where ``keep``: the
    forward's :func:`softmax_step` normalised by ``lse + lse_lo`` (``lse``, ``lse_lo`` broadcast to
    ``x``; ``lse_lo`` 0 when the caller applies ``2^-lse_lo`` per row afterwards)."""
    return tl.where(keep, tl.exp2(tl.fma(x, scale, -lse) - lse_lo) * weight, 0.0)


@triton.jit
def store_rows(acc, l_i, m_i, t, Out, so_b, so_h, so_n, LSE, LSE_LO, Hq, n, DV: tl.constexpr,
               HEAD_DV: tl.constexpr):
    """The forward's end: ``out = acc / l`` and the row statistics ``lse = m + log2 l`` rounded
    to float32 and ``lse_lo``, what that rounding lost (``m - lse`` is exact), from which the
    backward recomputes the probabilities as the forward normalised them (docs/triton.md)."""
    rmask = t.offs < n
    l_safe = tl.where(rmask, l_i, 1.0)
    store_tile(head_base(Out, t.b, t.h, so_b, so_h), acc / l_safe[:, None], t.offs, so_n, n, DV, HEAD_DV)
    l2 = tl.log2(l_safe)
    m_i = tl.where(rmask, m_i, 0.0)
    lse = m_i + l2
    row = (t.b.to(tl.int64) * Hq + t.h) * n + t.offs
    tl.store(LSE + row, lse, mask=rmask)
    tl.store(LSE_LO + row, (m_i - lse) + l2, mask=rmask)


class RowStats(NamedTuple):
    """Per-row statistics of one (batch, query head) for the backward: pointers to its ``lse``,
    ``lse_lo`` and ``delta`` rows (``[n]`` each, float32)."""
    lse: object
    lse_lo: object
    delta: object


@triton.jit
def row_stats(LSE, LSE_LO, DELTA, b, h, Hq, n):
    row = (b.to(tl.int64) * Hq + h.to(tl.int64)) * n
    return RowStats(LSE + row, LSE_LO + row, DELTA + row)


@triton.jit
def load_stats(st, offs, n):
    """``lse, lse_lo, delta`` of rows ``offs`` (0 past ``n``)."""
    mask = offs < n
    return (tl.load(st.lse + offs, mask=mask, other=0.0), tl.load(st.lse_lo + offs, mask=mask, other=0.0),
            tl.load(st.delta + offs, mask=mask, other=0.0))


@triton.jit(do_not_specialize=["n_tiles", "B", "Hq"])
def _bwd_pre_kernel(O, DO, DLSE, DELTA, sob, soh, son, sdb, sdh, sdn, n, n_tiles, B, Hq, dlse_scale,
                    DV: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr):
    """``delta_i = sum_d out_id * dout_id - dlse_scale * dlse_i`` (fp32; the ``dlse`` term only
    with ``HAS_DLSE``): ``ds = p (dp - delta)`` then includes the gradient through the lse
    (``d lse_i / d s_ij = p_ij``, ``dlse_scale`` converts the lse's base). 1-D grid over
    (tile, batch x head); both ops' backward."""
    pid = tl.program_id(0)
    bh = pid // n_tiles
    b, h = bh // Hq, bh % Hq
    offs = (pid % n_tiles) * BLOCK + tl.arange(0, BLOCK)
    o = load_tile(head_base(O, b, h, sob, soh), offs, son, n, DV, HEAD_DV)
    do = load_tile(head_base(DO, b, h, sdb, sdh), offs, sdn, n, DV, HEAD_DV)
    delta = tl.reduce(o.to(tl.float32) * do.to(tl.float32), 1, SUM)
    if HAS_DLSE:
        delta -= dlse_scale * tl.load(DLSE + bh.to(tl.int64) * n + offs, mask=offs < n, other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * n + offs, delta, mask=offs < n)
