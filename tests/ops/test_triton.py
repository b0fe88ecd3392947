"""Tests of the Triton backend (``poslsh.ops.triton``).

Without a GPU the kernels run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, set per test with ``monkeypatch``, so the rest of the
suite is unaffected). The interpreter runs the very kernels that are compiled for
CUDA, program by program, in numpy float32; inputs are float32 (the kernels
take fp16/bf16/fp32), the oracle is the dense float64 reference, and errors
are ``max |ours - ref| / max(max |ref|, 1)``: fp32 accumulation gives ~1e-7
to 1e-6, the bound is 2e-5 (well inside 1e-4). ``n = 1`` has
zero dq/dk in exact arithmetic, hence the ``max(..., 1)`` floor.

GPU tests (marked ``gpu``, skipped without CUDA, deselected by default in
pyproject): ``pytest -m gpu tests/ops/test_triton.py``.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import poslsh  # noqa: E402
from poslsh.partitions import Partitions, block_labels  # noqa: E402
import poslsh.ops.triton as pt  # noqa: E402
from poslsh.ops.triton import _config, _launch, _plan  # noqa: E402
from inputs import assert_compiles_like_eager  # noqa: E402

FP32_TOL = 2e-5
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _err(ours, ref) -> float:
    ref = ref.double()
    return ((ours.double() - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def _qkv(B, Hq, Hkv, n, d, dv=None, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    dv = d if dv is None else dv
    q = torch.randn(B, Hq, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, n, dv, generator=g, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


def _reference(q, k, v, parts, causal, dout):
    """Float64 dense oracle and its autograd gradients."""
    q, k, v = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    ref = poslsh.poslsh_attention_reference(q, k, v, parts.to("cpu"), causal=causal)
    grads = torch.autograd.grad(ref, (q, k, v), dout.double().cpu())
    return ref, grads


def _check(q, k, v, parts, causal, tol, label, backend="triton"):
    """Forward + backward through ``poslsh_attention(backend=...)`` vs the oracle."""
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = poslsh.poslsh_attention(qg, kg, vg, parts, causal=causal, backend=backend)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(dout.to(out))
    ref, (gq, gk, gv) = _reference(q, k, v, parts, causal, dout)
    errs = {"out": _err(out.cpu(), ref), "dq": _err(qg.grad.cpu(), gq),
            "dk": _err(kg.grad.cpu(), gk), "dv": _err(vg.grad.cpu(), gv)}
    print(f"{label}: " + "  ".join(f"{name} {e:.2e}" for name, e in errs.items()))
    assert out.dtype == q.dtype and qg.grad.dtype == q.dtype
    for name, e in errs.items():
        assert e < tol, f"{label}: {name} error {e:.3e} >= {tol}"
    return errs


# ---------------------------------------------------------------- plan (no kernel)
def _row_bounds(parts: Partitions, n: int):
    blk = parts.blocks(n)
    H, S = parts.widths.shape
    start = torch.repeat_interleave(blk.start, blk.length).view(H, S, n)
    end = torch.repeat_interleave(blk.start + blk.length, blk.length).view(H, S, n)
    return start, end


def _odd_partitions():
    w = torch.tensor([[0.3, 1.0, 1e-300, 5.5], [1e9, 2.0, 64.0, 7.25]], dtype=torch.float64)
    c = w * torch.tensor([[0.2, 0.9, 0.5, 0.99], [0.3, 0.0, 1.0, 0.5]], dtype=torch.float64)
    return Partitions(w, c)


PLAN_CASES = [lambda n: poslsh.sample_partitions(poslsh.alibi_sigmas(8) * 0.5, 5, seed=n), lambda n: _odd_partitions(),
              lambda n: Partitions.fixed_blocks(3, 16)]


@pytest.mark.parametrize("n", [1, 2, 17, 97, 300])
def test_plan_matches_partition_blocks(n):
    """The torch plan (the plan kernel's reference) is the core geometry: labels change
    exactly at block starts, granule bounds are ``block_bounds`` of the granule ends."""
    pos = torch.arange(n)
    for make in PLAN_CASES:
        parts = make(n)
        start, end = _row_bounds(parts, n)
        ids = _plan.block_ids(parts.widths, parts.offsets, n).long()
        assert bool((ids[..., 1:] >= ids[..., :-1]).all())
        new_block = torch.ones_like(ids, dtype=torch.bool)
        new_block[..., 1:] = ids[..., 1:] != ids[..., :-1]
        assert torch.equal(new_block, start == pos)
        gran = _plan.granule_bounds(parts.widths, parts.offsets, n)
        first = torch.arange(0, n, _plan.GRANULE)
        last = (first + _plan.GRANULE - 1).clamp(max=n - 1)
        assert torch.equal(gran[0].long(), start[..., first]) and torch.equal(gran[1].long(), end[..., last])
    order = _plan.head_order(torch.tensor([[1.0, 2.0], [50.0, 60.0], [5.0, 5.0], [100.0, 1.0]]), 1000, 2)
    assert order.tolist() == [1, 3, 2, 0, 0, 1]      # head work 3, 110, 10, 101; kv groups 113, 111


def test_plan_kernel_matches_core_geometry(interpret):
    """The one-launch plan kernel (interpreted here; the same code compiles for CUDA) gives
    the torch plan bit for bit: labels = :func:`poslsh.partitions.block_labels` (and
    ``Partitions.block_ids`` where labels are hashes), granule bounds = ``block_bounds``,
    and the head order."""
    for n in (1, 45, 200, 1100):
        for make in PLAN_CASES:
            parts = make(n)
            H, S = parts.widths.shape
            group = 1 if H % 2 else 2
            got = _launch.build_plan(parts.widths, parts.offsets, n, group)
            ref = _plan.plan(parts.widths, parts.offsets, n, group)
            core = block_labels(parts.widths, parts.offsets, torch.arange(n, dtype=torch.float64))
            assert torch.equal(got.ids, core.to(torch.int32)), (n, parts)
            assert torch.equal(got.gran, ref.gran) and torch.equal(got.order, ref.order), (n, parts)
            if bool((parts.widths > 1).all()):
                assert torch.equal(got.ids.long(), parts.block_ids(n))


def test_tile_blocks_match_partition_blocks(interpret):
    """What each program derives from the plan (``_tile_blocks`` + ``_block_bounds``): the
    union range ``[lo, hi)``, the number ``R`` of (sample, block) pairs touching its tile
    and, when ``R <= R_MAX``, exactly those blocks (``Partitions.blocks``)."""
    mod = _launch.kernels(True)
    for parts, n, P in [(poslsh.sample_partitions(torch.tensor([3.0, 30.0, 300.0]), 4, seed=2), 150, 32),
                        (_odd_partitions(), 70, 16), (Partitions.fixed_blocks(2, 40), 100, 64)]:
        H, S = parts.widths.shape
        p = _launch.build_plan(parts.widths, parts.offsets, n, 1)
        nt = (n + P - 1) // P
        lohi = torch.full((H * nt, 3), -7, dtype=torch.int32)
        blocks = torch.full((H * nt, 2, 32), -7, dtype=torch.int32)
        mod._tile_blocks_kernel[(H * nt,)](p.ids, p.gran, lohi, blocks, n, p.gran.shape[-1], p.gran[0].numel(), S, nt,
                                           R_MAX=32, P=P, SC=16)
        lo, hi, R = _plan.tile_ranges(parts.widths, parts.offsets, n, P, causal=False)
        assert torch.equal(lohi[:, 0].long(), lo.reshape(-1)) and torch.equal(lohi[:, 1].long(), hi.reshape(-1))
        assert torch.equal(lohi[:, 2].long(), R.reshape(-1))
        blk = parts.blocks(n)
        for h in range(H):
            for t in range(nt):
                i = h * nt + t
                if int(R[h, t]) > 32:
                    continue
                p0, p1 = t * P, min(n, (t + 1) * P)
                mine = (blk.head == h) & (blk.start < p1) & (blk.start + blk.length > p0)
                want = sorted(zip(blk.sample[mine].tolist(), blk.start[mine].tolist(),
                                  (blk.start + blk.length)[mine].tolist()))
                got = list(zip(blocks[i, 0, :int(R[h, t])].tolist(), blocks[i, 1, :int(R[h, t])].tolist()))
                assert got == [(a, b) for _, a, b in want], (h, t)
                assert (blocks[i, :, int(R[h, t]):] == 0).all()          # unused lanes: empty intervals


# ---------------------------------------------------------------- interpreter
CASES = [  # n, causal, (BLOCK_M, BLOCK_N) under the interpreter, TMA descriptors or pointers, s, batch
    (1, False, (32, 32), True, 3, 1), (1, True, (32, 32), True, 3, 1),
    (2, True, (32, 32), True, 3, 1),
    (97, False, (64, 32), True, 3, 2), (97, True, (64, 32), False, 3, 1),
    (200, True, (64, 64), True, 2, 1),
]
SIGMAS = torch.tensor([1.5, 6.0, 40.0, 400.0], dtype=torch.float64)


def _set_tiles(mp, bm, bn):
    mp.setitem(_launch.INTERPRET_BLOCKS, "fwd", (bm, bn))
    mp.setitem(_launch.INTERPRET_BLOCKS, "dq", (bm, bn))
    mp.setitem(_launch.INTERPRET_BLOCKS, "dkdv", (bn, bm))


@pytest.mark.parametrize("n,causal,tiles,tma,s,batch", CASES)
def test_interpreter_matches_reference(interpret, n, causal, tiles, tma, s, batch):
    """GQA Hq=4 / Hkv=2; heads from tiny blocks (many per tile: label compares) to blocks
    longer than the tiles (one-hot MMA count); both ways of loading tiles."""
    bm, bn = tiles
    interpret.setattr(_launch, "FORCE_TMA", tma)
    _set_tiles(interpret, bm, bn)
    parts = poslsh.sample_partitions(SIGMAS, s, seed=7)
    if n > 64:   # the case covers both count methods, in forward and in dk/dv
        for tile, other, tr in ((bm, bn, False), (bn, bm, True)):
            lo, hi, R = _plan.tile_ranges(parts.widths, parts.offsets, n, tile, causal, transpose=tr)
            assert 0 < int((R <= _config.R_MAX).sum()) < R.numel()
    q, k, v = _qkv(batch, 4, 2, n, 16, dtype=torch.float32, seed=n)
    _check(q, k, v, parts, causal, FP32_TOL, f"interp n={n} causal={causal} tiles={tiles} tma={tma} s={s} B={batch}")


def test_interpreter_split_launches(interpret):
    """On a GPU each kernel runs twice, one-hot programs then label-compare programs
    (``PATH`` 1 and 2); the same result, and the one-hot method's count for every program."""
    n = 80
    _set_tiles(interpret, 32, 32)
    parts = poslsh.sample_partitions(SIGMAS, 3, seed=3)
    q, k, v = _qkv(1, 4, 2, n, 16, dtype=torch.float32, seed=5)
    interpret.setattr(_launch, "SPLIT", True)
    _launch.LAUNCHES.clear()
    _check(q, k, v, parts, True, FP32_TOL, "interp split launches")
    assert _launch.LAUNCHES["fwd"] == 2 and _launch.LAUNCHES["dkdv"] == 2 and _launch.LAUNCHES["dq"] == 2
    interpret.setattr(_launch, "SPLIT", False)
    interpret.setitem(_launch.ONEHOT_MAX, "r_max", 64)      # more programs on the one-hot path
    _check(q, k, v, parts, True, FP32_TOL, "interp R_MAX=64")


@pytest.mark.parametrize("causal", [False, True])
def test_interpreter_odd_partitions_and_head_dims(interpret, causal):
    """Widths <= 1 (singleton blocks), one block longer than n, fixed blocks (s=1,
    interior tiles), non power-of-two head dims (d=24, dv=40), MQA (Hkv=1), query
    and key tiles of different sizes."""
    n = 70
    interpret.setitem(_launch.INTERPRET_BLOCKS, "fwd", (32, 16))
    interpret.setitem(_launch.INTERPRET_BLOCKS, "dq", (16, 32))
    interpret.setitem(_launch.INTERPRET_BLOCKS, "dkdv", (32, 16))
    q, k, v = _qkv(1, 2, 1, n, 24, dv=40, dtype=torch.float32, seed=3)
    _check(q, k, v, _odd_partitions(), causal, FP32_TOL, f"odd partitions causal={causal}")
    q, k, v = _qkv(1, 2, 2, n, 16, dtype=torch.float32, seed=4)
    _check(q, k, v, Partitions.fixed_blocks(2, 40), causal, FP32_TOL, f"fixed blocks causal={causal}")


def test_interpreter_float16(interpret):
    """fp16 inputs (16-bit loads, p cast to fp16 for the PV / dS matmuls, fp16 stores).
    bfloat16 cannot be checked here: Triton 3.9's interpreter multiplies bf16 tiles as
    their raw uint16 bits in ``tl.dot`` (create_dot calls np.matmul on the storage),
    so bf16 is covered by the GPU tests only."""
    q, k, v = _qkv(1, 2, 1, 50, 16, dtype=torch.float16, seed=12)
    parts = poslsh.sample_partitions(torch.tensor([2.0, 30.0], dtype=torch.float64), 3, seed=1)
    _check(q, k, v, parts, True, 5e-3, "interp float16")


def test_interpreter_strided_inputs_and_scale(interpret):
    """q/k/v as [B, n, H, d] transposed views (no copy), an explicit scale."""
    n, d = 45, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, n, 2, d, generator=g).transpose(1, 2)
    k = torch.randn(1, n, 1, d, generator=g).transpose(1, 2)
    v = torch.randn(1, n, 1, d, generator=g).transpose(1, 2)
    parts = poslsh.sample_partitions(torch.tensor([3.0, 30.0], dtype=torch.float64), 2, seed=2)
    assert not q.is_contiguous()
    out = poslsh.poslsh_attention(q, k, v, parts, causal=True, scale=0.7, backend="triton")
    ref = poslsh.poslsh_attention_reference(q.double(), k.double(), v.double(), parts, causal=True, scale=0.7)
    e = _err(out, ref)
    print(f"strided inputs: out {e:.2e}")
    assert e < FP32_TOL


def test_same_seed_same_result_on_every_backend(interpret):
    """One seed -> one set of partitions -> the same output on triton, torch and reference."""
    n = 64
    q, k, v = _qkv(1, 2, 2, n, 16, dtype=torch.float32, seed=11)
    outs = {}
    for backend in ("triton", "torch", "reference"):
        parts = poslsh.sample_partitions(poslsh.alibi_sigmas(2), 4, seed=123)
        outs[backend] = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend=backend)
    e1, e2 = _err(outs["triton"], outs["torch"]), _err(outs["triton"], outs["reference"])
    print(f"same seed: triton vs torch {e1:.2e}, triton vs reference {e2:.2e}")
    assert e1 < FP32_TOL and e2 < FP32_TOL


# ---------------------------------------------------------------- registration, checks, fake
def test_availability_and_registration(monkeypatch):
    q = torch.zeros(1, 1, 4, 16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "triton" in poslsh.available_backends()
    assert not pt.is_available(q)                       # CPU without the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pt.is_available(q)
    assert not pt.is_available(q.double())              # float64: use the torch backend
    assert not pt.is_available(torch.zeros(1, 1, 4, 512))
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(1), 2, seed=0)
    with pytest.raises(ValueError, match="cannot run"):
        poslsh.poslsh_attention(q.double(), q.double(), q.double(), parts, backend="triton")
    # backend="auto" never picks the interpreter on CPU
    out = poslsh.poslsh_attention(q, q, q, parts, backend="auto")
    assert out.shape == q.shape


def test_tma_only_when_aligned():
    x = torch.zeros(1, 2, 8, 16)
    assert _launch.use_tma(True, x, x)
    assert not _launch.use_tma(True, torch.zeros(1, 2, 8, 18))          # 72-byte rows: not a multiple of 16
    assert not _launch.use_tma(True, torch.zeros(1, 2, 8, 20)[..., 1:17])  # base address off by 4 bytes
    assert not _launch.use_tma(False, x)                                 # compiled on CPU: never
    y = torch.zeros(1, 8, 2, 16).transpose(1, 2)                         # strided rows, aligned
    assert _launch.use_tma(True, y)


def test_kernel_constraints_are_checked():
    q = torch.zeros(1, 2, 8, 16)
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(2), 2, seed=0)
    with pytest.raises(ValueError, match="head dims"):
        _launch.check_inputs(torch.zeros(1, 2, 8, 320), torch.zeros(1, 2, 8, 320), torch.zeros(1, 2, 8, 320),
                             parts.widths, parts.offsets)
    many = poslsh.sample_partitions(poslsh.alibi_sigmas(2), 300, seed=0)     # any s: the sample loop is a runtime loop
    assert _launch.check_inputs(q, q, q, many.widths, many.offsets)[-1] == 300
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        _launch.check_inputs(q.double(), q.double(), q.double(), parts.widths, parts.offsets)
    with pytest.raises(ValueError, match="partitions"):
        one = poslsh.sample_partitions(poslsh.alibi_sigmas(1), 2, seed=0)
        _launch.check_inputs(q, q, q, one.widths, one.offsets)
    with pytest.raises(ValueError, match="tile sizes"):
        _launch._kernel_and_metas("fwd", True, (24, 32), {}, q)


def test_versions_are_checked(monkeypatch):
    """triton >= 3.4 (tensor descriptors) or a clear error; the interpreter under triton < 3.9
    with numpy >= 2.4 is reported (its tests skip with that reason), not run into."""
    import numpy
    assert _config.MIN_TRITON == (3, 4)
    monkeypatch.setattr(_config, "TRITON_VERSION", (3, 3))
    q = torch.zeros(1, 2, 8, 16)
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(2), 2, seed=0)
    with pytest.raises(RuntimeError, match=r"triton >= 3.4"):
        _launch.check_inputs(q, q, q, parts.widths, parts.offsets)
    monkeypatch.setattr(_config, "TRITON_VERSION", (3, 6))
    monkeypatch.setattr(numpy, "__version__", "2.5.0")
    assert "triton-lang/triton#9171" in _config.interpreter_problem()
    monkeypatch.setattr(numpy, "__version__", "2.3.5")
    assert _config.interpreter_problem() is None
    monkeypatch.setattr(_config, "TRITON_VERSION", (3, 9))
    monkeypatch.setattr(numpy, "__version__", "2.5.0")
    assert _config.interpreter_problem() is None


def test_configs_pruned_by_shared_memory():
    """Configurations that need more than a Hopper SM's 227 KiB (by ``_config.smem_estimate``,
    an upper bound of what triton allocated for every configuration benchmarks/triton_static.py
    compiled for sm_90) are dropped before anything is compiled: fp32 d=128 keeps only those
    that fit, or the small fallback; bf16 d=128 keeps the lists whole."""
    for name, configs in _config.CONFIGS.items():
        bf16 = _config.prune(name, configs, {}, HEAD_DIM=128, HEAD_DV=128, DOT_PREC="tf32")
        assert bf16 == configs, name
        fp32 = _config.prune(name, configs, {}, HEAD_DIM=128, HEAD_DV=128, DOT_PREC="tf32x3")
        fits = [c for c in configs if _config.smem_estimate(name, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"],
                                                            c.num_stages, 128, 128, 4) <= _config.DEFAULT_SMEM]
        assert fp32 == (fits or [_config.FALLBACK[name]]), name
        print(f"{name}: fp32 d=128 keeps {[(c.kwargs['BLOCK_M'], c.kwargs['BLOCK_N'], c.num_stages) for c in fp32]}")
    assert len(_config.prune("fwd", _config.FWD_CONFIGS, {}, HEAD_DIM=128, HEAD_DV=128, DOT_PREC="tf32x3")) == 1


@pytest.mark.parametrize("name", ["fwd", pytest.param("dkdv", marks=pytest.mark.slow),
                                  pytest.param("dq", marks=pytest.mark.slow)])
def test_default_configs_compile_for_sm90(name):
    """Compile-only (no GPU): the first configuration of each kernel lowers for sm_90 with the
    installed triton, needs no more shared memory than the pruning model says and spills
    little (none under triton 3.6 and 3.9 when this was written) (bf16, d = 128, both count paths, the compare path also with lattice counts). ~5 s per kernel on 2 cores; the forward runs by
    default, dk/dv and dq with ``-m slow``; benchmarks/triton_static.py compiles them all."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import triton_static
    mod = _launch.kernels(False)
    fn = {"fwd": mod._fwd_kernel, "dkdv": mod._bwd_dkdv_kernel, "dq": mod._bwd_dq_kernel}[name]
    for path, lattice in ((1, False), (2, False), (2, True)):
        c = _config.CONFIGS[_config.list_name(name, path)][0]      # the compare launch has its own list
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        consts = dict(CAUSAL=True, D=128, DV=128, HEAD_DIM=128, HEAD_DV=128, USE_TMA=True, R_MAX=_config.R_MAX,
                      SC=_config.SAMPLE_CHUNK, PATH=path, DOT_PREC="tf32", BLOCK_M=bm, BLOCK_N=bn, LATTICE=lattice,
                      CLASS_TILE=_config.CLASS_TILE[name], ROW_PLANS=False)
        r = triton_static.compile_sm90(fn, triton_static._types(fn, "bf16"), consts, c.num_warps, c.num_stages,
                                       triton_static._aligned(fn))
        print(name, path, "lattice" if lattice else "", r)
        assert r["smem"] <= _config.smem_estimate(name, bm, bn, c.num_stages, 128, 128, 2)
        assert r["spill_st"] <= 1024


def test_grid_is_one_axis(monkeypatch):
    """Every launch has a 1-D grid (B x H x tiles on axis 0, up to 2^31 - 1): B x H is not
    capped at 65,535. Checked on the grids the launcher builds (no kernel runs)."""
    seen = []
    monkeypatch.setattr(_launch, "_launch", lambda name, kernel, grid, args, meta, t: seen.append(
        (name, grid(meta) if callable(grid) else grid)))
    monkeypatch.setattr(_launch, "get_plan", lambda w, c, n, g, groups=None: _plan.Plan(torch.zeros(1, dtype=torch.int32),
                                                                          torch.zeros(2, 1, dtype=torch.int32),
                                                                          torch.zeros(1, dtype=torch.int32)))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    B, H, n = 300, 256, 40                                  # B x H = 76,800 > 65,535
    q = torch.zeros(B, H, n, 16)
    parts = Partitions(torch.full((H, 2), 5.0, dtype=torch.float64), torch.zeros(H, 2, dtype=torch.float64))
    out, lse, lo = _launch.forward(q, q, q, parts.widths, parts.offsets, True, 0.25)
    _launch.backward(out, q, q, q, out, lse, lo, parts.widths, parts.offsets, True, 0.25)
    tiles = {"fwd": 2, "dq": 2, "dkdv": 2, "bwd_pre": 1}    # interpreter tiles 32x32, pre-kernel 64 rows
    assert [name for name, _ in seen] == ["fwd", "bwd_pre", "dkdv", "dq"]
    for name, grid in seen:
        assert len(grid) == 1 and grid[0] == B * H * tiles[name], (name, grid)


def test_plan_is_built_once_and_shared(interpret):
    """One plan launch per (partitions, n, group): forward and backward share it, a second
    call builds nothing; other partitions or an in-place change build a new one. Launches
    of a forward + backward under the interpreter: plan 1 (first call only), fwd 1,
    bwd_pre 1, dk/dv 1, dq 1."""
    _set_tiles(interpret, 32, 32)
    parts = poslsh.sample_partitions(torch.tensor([2.0, 50.0], dtype=torch.float64), 3, seed=4)
    q, k, v = (x.requires_grad_() for x in _qkv(1, 2, 1, 40, 16, dtype=torch.float32, seed=6))
    _plan.CACHE.clear()
    for call in range(2):
        _launch.LAUNCHES.clear()
        poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="triton").sum().backward()
        want = {"fwd": 1, "bwd_pre": 1, "dkdv": 1, "dq": 1, **({"plan": 1} if call == 0 else {})}
        print(f"call {call}: launches {dict(_launch.LAUNCHES)}")
        assert dict(_launch.LAUNCHES) == want
    builds = _plan.CACHE.builds
    other = poslsh.sample_partitions(torch.tensor([2.0, 50.0], dtype=torch.float64), 3, seed=5)
    poslsh.poslsh_attention(q, k, v, other, causal=True, backend="triton")
    assert _plan.CACHE.builds == builds + 1
    with torch.no_grad():
        parts.offsets.mul_(0.5)                       # in place: a new version, a new plan
    a = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="triton")
    assert _plan.CACHE.builds == builds + 2
    b = poslsh.poslsh_attention_reference(q.double(), k.double(), v.double(), parts, causal=True)
    assert _err(a, b) < FP32_TOL
    del other
    import gc
    gc.collect()
    assert len(_plan.CACHE) <= _plan.CACHE.size


def test_fake_and_meta_implementations():
    """Shapes/dtypes/strides from the fake kernels, with no kernel run (FakeTensorMode and meta)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, Hq, Hkv, n, d, dv = 2, 4, 2, 1000, 64, 32
    with FakeTensorMode():
        q = torch.empty(B, n, Hq, d, dtype=torch.bfloat16).transpose(1, 2)   # strided input
        k = torch.empty(B, Hkv, n, d, dtype=torch.bfloat16)
        v = torch.empty(B, Hkv, n, dv, dtype=torch.bfloat16)
        w = torch.empty(Hq, 10, dtype=torch.float64)
        out, lse, lo = torch.ops.poslsh.triton_attention_fwd(q, k, v, w, w, True, 0.125)
        assert out.shape == (B, Hq, n, dv) and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert lse.shape == lo.shape == (B, Hq, n) and lse.dtype == lo.dtype == torch.float32
        dq, dk, dvv = torch.ops.poslsh.triton_attention_bwd(out, q, k, v, out, lse, lo, w, w, True, 0.125)
        assert dq.shape == q.shape and dq.is_contiguous() and dk.shape == k.shape and dvv.shape == v.shape
    meta = [torch.empty(s, device="meta", dtype=torch.float16) for s in ((1, 2, 77, 16), (1, 1, 77, 16))]
    w = torch.empty(2, 3, dtype=torch.float64, device="meta")
    out, lse, _ = torch.ops.poslsh.triton_attention_fwd(meta[0], meta[1], meta[1], w, w, False, 0.25)
    assert out.device.type == "meta" and out.shape == (1, 2, 77, 16)


def test_opcheck(interpret):
    """torch.library.opcheck: schema, fake tensor vs real kernel, autograd registration."""
    q, k, v = _qkv(1, 2, 1, 20, 16, dtype=torch.float32, seed=8)
    parts = poslsh.sample_partitions(torch.tensor([2.0, 9.0], dtype=torch.float64), 2, seed=1)
    torch.library.opcheck(torch.ops.poslsh.triton_attention_fwd.default,
                          (q, k, v, parts.widths, parts.offsets, True, 0.25),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_compile_fullgraph_cpu(interpret):
    """torch.compile(fullgraph=True) traces the op (fake impl) and its backward
    (aot_eager: no C++ compiler needed); the compiled and eager results agree."""
    q, k, v = (x.requires_grad_() for x in _qkv(1, 2, 1, 24, 16, dtype=torch.float32, seed=9))
    parts = poslsh.sample_partitions(torch.tensor([2.0, 9.0], dtype=torch.float64), 2, seed=1)

    def loss(q, k, v):
        return pt.attention(q, k, v, parts, causal=True).square().sum()

    assert_compiles_like_eager(loss, q, k, v)


# ---------------------------------------------------------------- GPU
GPU_TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}


# Kept to a few compiled variants (dtype, head dim, causality): each one compiles 7 kernels
# (forward x 2 count paths, delta, dk/dv x 2, dq x 2), and the first GPU run has minutes.
GPU_CASES = [(torch.bfloat16, 128, True), (torch.bfloat16, 64, False), (torch.float16, 64, True),
             (torch.float32, 64, True)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,d,causal", GPU_CASES)
def test_gpu_matches_reference(dtype, d, causal):
    n = 1024
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(4) * 4, 10, seed=0).to("cuda")
    q, k, v = _qkv(2, 4, 2, n, d, dtype=dtype, device="cuda", seed=d)
    _check(q, k, v, parts, causal, GPU_TOL[dtype], f"gpu {dtype} d={d} causal={causal}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_odd_head_dims_and_partitions():
    n = 777
    q, k, v = _qkv(1, 2, 1, n, 80, dv=96, dtype=torch.bfloat16, device="cuda", seed=2)
    _check(q, k, v, _odd_partitions().to("cuda"), True, GPU_TOL[torch.bfloat16], "gpu odd partitions d=80 dv=96")
    _check(q, k, v, Partitions.fixed_blocks(2, 256, device="cuda"), True, GPU_TOL[torch.bfloat16],
           "gpu fixed blocks")


@pytest.mark.gpu
@needs_cuda
def test_gpu_plan_kernel_is_the_core_geometry():
    """The compiled plan kernel (float64 division and floor on the GPU; the multiply-add in
    bin_start may be fused, which the two hash tests absorb) equals the torch plan bit for bit."""
    for parts, n in ((poslsh.sample_partitions(poslsh.alibi_sigmas(16), 10, seed=1), 100003),
                     (_odd_partitions(), 4099), (Partitions.fixed_blocks(3, 16), 1000)):
        parts = parts.to("cuda")
        got = _launch.build_plan(parts.widths, parts.offsets, n, 1)
        ref = _plan.plan(parts.widths, parts.offsets, n, 1)
        assert torch.equal(got.ids, ref.ids) and torch.equal(got.gran, ref.gran) and torch.equal(got.order, ref.order)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_launches_on_the_tensors_device():
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(4), 10, seed=0).to("cuda:1")
    q, k, v = _qkv(1, 4, 4, 512, 64, dtype=torch.bfloat16, device="cuda:1")
    with torch.cuda.device(0):
        _check(q, k, v, parts, True, GPU_TOL[torch.bfloat16], "gpu cuda:1 while cuda:0 is current")


@pytest.mark.gpu
@needs_cuda
def test_gpu_auto_picks_triton_and_agrees_with_torch_backend():
    assert "triton" in poslsh.available_backends(torch.zeros(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16))
    n = 4096
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(8), 10, seed=3).to("cuda")
    q, k, v = _qkv(1, 8, 8, n, 64, dtype=torch.float32, device="cuda", seed=3)
    a = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="auto")
    b = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="triton")
    c = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="torch")
    assert torch.equal(a, b)
    e = _err(b, c)
    print(f"gpu triton vs torch backend (fp32, n={n}): {e:.2e}")
    assert e < 1e-4


def _compiled_matches_eager(fn, q, k, v):
    torch._dynamo.reset()
    lc = torch.compile(fn, fullgraph=True)(q, k, v)
    gc = torch.autograd.grad(lc, (q, k, v))
    le = fn(q, k, v)
    ge = torch.autograd.grad(le, (q, k, v))
    assert torch.allclose(lc, le, rtol=1e-3, atol=1e-5)
    for a, b in zip(gc, ge):
        assert _err(a, b) < 1e-3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ["custom_op", "dispatcher"])
def test_gpu_compile_fullgraph(path):
    """torch.compile(fullgraph=True) through the custom op itself and through poslsh_attention."""
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(4), 8, seed=0).to("cuda")
    q, k, v = (x.requires_grad_() for x in _qkv(1, 4, 2, 2048, 64, dtype=torch.bfloat16, device="cuda"))

    def attend(q, k, v):      # non-causal bf16 d=64: the variant test_gpu_matches_reference compiled
        if path == "custom_op":
            return pt.attention(q, k, v, parts, causal=False)
        return poslsh.poslsh_attention(q, k, v, parts, causal=False, backend="triton")

    def loss(q, k, v):
        return attend(q * 1.0, k, v).float().square().mean()
    _compiled_matches_eager(loss, q, k, v)


@pytest.mark.gpu
@needs_cuda
def test_gpu_long_sequence_runs():
    """n = 131072, 16 ALiBi heads, d = 128, s = 10, bf16: forward + backward, finite,
    and a sample of rows agrees with a dense float64 evaluation of those rows."""
    n, H, d = 131072, 16, 128
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(H), 10, seed=0).to("cuda")
    q, k, v = (x.requires_grad_() for x in _qkv(1, H, H, n, d, dtype=torch.bfloat16, device="cuda"))
    out = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="triton")
    out.float().square().mean().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    # rows near the end: keys within the last 4096 positions cover every block they touch for sigma <= 256
    rows = torch.arange(n - 64, n, device="cuda")
    lo = n - 4096
    start, _ = _plan.block_bounds(parts.widths, parts.offsets, n, rows)
    assert int(start.min()) >= lo, "a block of the sampled rows starts before the dense window"
    ids = _plan.block_ids(parts.widths, parts.offsets, n)[..., lo:]            # [H, s, 4096]
    count = (ids[:, :, rows - lo, None] == ids[:, :, None, :]).sum(1).double()  # [H, 64, 4096]
    keypos = torch.arange(lo, n, device="cuda")
    count = count.masked_fill(keypos[None, None, :] > rows[None, :, None], 0)
    with torch.no_grad():
        s = torch.einsum("hid,hkd->hik", q[0, :, rows].double(), k[0, :, lo:].double()) / math.sqrt(d)
        s = s + count.log()
        ref = torch.softmax(s, -1) @ v[0, :, lo:].double()
    e = _err(out[0, :, rows], ref)
    print(f"gpu n={n}: last-64-rows error {e:.2e}")
    assert e < 1e-2


def test_double_backward_is_a_clear_error(interpret):
    """The Triton gradients are not differentiable: create_graph=True raises one line that
    names the way out, instead of wrong second-order gradients."""
    parts = poslsh.sample_partitions(torch.tensor([1.5, 6.0]), 2, seed=0)
    q, k, v = (torch.randn(1, 2, 17, 16, requires_grad=True) for _ in range(3))
    out = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="triton")
    with pytest.raises(RuntimeError, match="double backward.*backend='torch'"):
        torch.autograd.grad(out.square().sum(), (q,), create_graph=True)


# ---------------------------------------------------------------- grouped partitions
def _grouped_partitions(s=10, seed=3):
    """Grouped partitions whose heads range from widths <= 1 (one position per block) to
    blocks longer than the sequence: groups of 4, 3, 3 shifted grids per head."""
    sig = torch.tensor([0.3, 1.5, 6.0, 40.0, 400.0, 1e6], dtype=torch.float64)
    return poslsh.sample_partitions(sig, s, seed=seed, sampler="grouped")


@pytest.mark.parametrize("n", [1, 2, 97, 300])
def test_lattice_index_counts_like_every_sample(n):
    """The plan's lattice indices give each group's count as ``max(0, k - |lat_i - lat_j|)``;
    summed over the groups this is the per-sample count of the core geometry, every pair."""
    parts = _grouped_partitions()
    lat, ksz = _plan.lattice_index(parts.widths, parts.offsets, parts.groups, n)
    assert lat.shape == (6, parts.num_groups, n) and lat.dtype == torch.int32
    diff = (lat[..., :, None] - lat[..., None, :]).abs().long()                     # [H, G, n, n]
    count = (ksz[..., None, None].long() - diff).clamp(min=0).sum(1)
    want = parts.dense_count(n).long()
    print(f"n={n}: groups {parts.num_groups}, pairs differing {(count != want).sum().item()}")
    assert torch.equal(count, want)


@pytest.mark.parametrize("n,causal", [(1, False), (2, True), (97, True), (97, False),
                                      pytest.param(1025, True, marks=pytest.mark.slow)])
def test_interpreter_grouped_partitions(interpret, n, causal):
    """Grouped partitions on the Triton kernels: the label-compare path counts a group at a
    time from the lattice (forced for every program with R_MAX = 8 < s), the default mixes it
    with the one-hot path; GQA 6/2 heads, batch 2, forward and backward vs the oracle."""
    parts = _grouped_partitions()
    q, k, v = _qkv(2, 6, 2, n, 16, dtype=torch.float32, seed=n)
    _set_tiles(interpret, 32, 32)
    for r_max in (8, 32):
        interpret.setitem(_launch.ONEHOT_MAX, "r_max", r_max)
        _check(q, k, v, parts, causal, FP32_TOL, f"grouped n={n} causal={causal} R_MAX={r_max}")
    plan = _launch.get_plan(parts.widths, parts.offsets, n, 3, parts.groups)
    assert plan.lat is not None and plan.lat.shape[1] == parts.num_groups == 3


def test_interpreter_grouped_count_reads_the_lattice(interpret):
    """The compare path really counts from the lattice: a corrupted lattice index in the
    cached plan changes the output (and the i.i.d. plan of the same masks has none)."""
    n = 64
    parts = _grouped_partitions()
    q, k, v = _qkv(1, 6, 2, n, 16, dtype=torch.float32, seed=2)
    _set_tiles(interpret, 32, 32)
    interpret.setitem(_launch.ONEHOT_MAX, "r_max", 8)
    _plan.CACHE.clear()
    good = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="triton")
    plan = _launch.get_plan(parts.widths, parts.offsets, n, 3, parts.groups)
    plan.lat[3].mul_(2)                                       # the sigma = 40 head: blocks of ~80
    bad = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="triton")
    print(f"corrupted lattice: head 3 changes by {(bad - good)[:, 3].abs().max():.3e}, others by "
          f"{(bad - good)[:, [0, 1, 2, 4, 5]].abs().max():.3e}")
    assert (bad - good)[:, 3].abs().max() > 1e-3 and torch.equal(bad[:, [0, 1, 2, 4, 5]], good[:, [0, 1, 2, 4, 5]])
    iid = Partitions(parts.widths, parts.offsets, parts.sigma)
    assert _launch.get_plan(iid.widths, iid.offsets, n, 3, None).lat is None
    _plan.CACHE.clear()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_grouped_partitions(dtype):
    """Grouped partitions on the GPU kernels (lattice counts), vs the float64 oracle."""
    parts = _grouped_partitions(s=20).to("cuda")
    q, k, v = _qkv(2, 6, 2, 1025, 64, dtype=dtype, device="cuda", seed=11)
    _check(q, k, v, parts, True, FP32_TOL if dtype == torch.float32 else 2e-2, f"gpu grouped {dtype}")


_STATIC = '''
import argparse, sys
sys.path.insert(0, "benchmarks")
import triton_static
from poslsh.ops.triton import _launch
args = argparse.Namespace(heads=4, samples=3)
triton_static.section_launches(args)                 # interpreter launches first, as with no flags
fn = _launch.kernels(False)._plan_kernel
r = triton_static.compile_sm90(fn, triton_static._types(fn, "fp32"), dict(BLOCK=1024, H_PAD=16), 4, 1, ["IDS"])
print("compiled", r["regs"])
'''


def test_static_checks_compile_after_the_launch_count():
    """benchmarks/triton_static.py with no flags counts launches under the interpreter before it
    compiles: triton must not be imported in interpreter mode then (its own helpers would be
    decorated for the interpreter and every compile fail). A fresh process: launches, then a compile."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _STATIC], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    print(r.stdout[-2000:], r.stderr[-2000:])
    assert r.returncode == 0 and "compiled" in r.stdout


@pytest.mark.slow
def test_static_checks_with_no_flags():
    """The whole script as docs/triton.md runs it: every kept configuration compiles for sm_90
    within the shared-memory model (exit status 0, no FAILED line). Minutes on 2 cores."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "benchmarks/triton_static.py", "--n", "16384"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=3600)
    print(r.stdout[-6000:])
    assert r.returncode == 0 and "FAILED" not in r.stdout and "compile check: PASS" in r.stdout
