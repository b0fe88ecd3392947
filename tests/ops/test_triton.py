"""Tests of the Triton backend (``poslsh.ops.triton``).

Without a GPU the kernels run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, set per test with ``monkeypatch``, so the rest of the
suite is unaffected). The interpreter runs the very kernels that are compiled for
CUDA, program by program, in numpy float32; inputs are float32 (the kernels
take fp16/bf16/fp32), the oracle is the dense float64 reference, and errors
are ``max |ours - ref| / max(max |ref|, 1)``: fp32 accumulation gives ~1e-7
to 1e-6, the bound is 2e-5 (the issue asks < 1e-4 for fp32). ``n = 1`` has
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
from poslsh.ops.triton import _launch, _plan  # noqa: E402

FP32_TOL = 2e-5
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield monkeypatch


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


@pytest.mark.parametrize("n", [1, 2, 17, 97, 300])
def test_plan_matches_partition_blocks(n):
    cases = [poslsh.sample_partitions(poslsh.alibi_sigmas(8) * 0.5, 5, seed=n), _odd_partitions(),
             Partitions.fixed_blocks(3, 16)]
    pos = torch.arange(n)
    for parts in cases:
        start, end = _row_bounds(parts, n)
        ids = _plan.block_ids(parts.widths, parts.offsets, n).long()
        # labels are nondecreasing and change exactly at block starts
        assert bool((ids[..., 1:] >= ids[..., :-1]).all())
        new_block = torch.ones_like(ids, dtype=torch.bool)
        new_block[..., 1:] = ids[..., 1:] != ids[..., :-1]
        assert torch.equal(new_block, start == pos)
        s, e = _plan.block_bounds(parts.widths, parts.offsets, n, pos)
        assert torch.equal(s, start) and torch.equal(e, end)
        gran = _plan.granule_bounds(parts.widths, parts.offsets, n)
        first = torch.arange(0, n, _plan.GRANULE)
        last = (first + _plan.GRANULE - 1).clamp(max=n - 1)
        for row, (tbl, p) in enumerate([(start, first), (end, first), (start, last), (end, last)]):
            assert torch.equal(gran[row].long(), tbl[..., p])
    order = _plan.head_order(torch.tensor([[1.0, 2.0], [50.0, 60.0], [5.0, 5.0], [100.0, 1.0]]), 1000, 2)
    assert order.tolist() == [1, 3, 2, 0, 0, 1]      # head work 3, 110, 10, 101; kv groups 113, 111


def test_ids_kernel_matches_plan():
    """The Triton kernel that computes the block labels on GPU (run here under the
    interpreter) gives exactly the core geometry, :func:`poslsh.partitions.block_labels`
    (through ``_plan.block_ids``, and ``Partitions.block_ids`` where labels are hashes)."""
    kern = _launch.kernels(True)._ids_kernel
    for parts in (_odd_partitions(), poslsh.sample_partitions(poslsh.alibi_sigmas(4), 3, seed=5)):
        for n in (1, 45, 200):
            H, S = parts.widths.shape
            ids = torch.full((H, S, n), -7, dtype=torch.int32)
            kern[((n + 63) // 64, H * S)](parts.widths.contiguous(), parts.offsets.contiguous(), ids, n, BLOCK=64)
            core = block_labels(parts.widths, parts.offsets, torch.arange(n, dtype=torch.float64))
            assert torch.equal(ids, core.to(torch.int32))
            assert torch.equal(ids, _plan.block_ids(parts.widths, parts.offsets, n))
            if bool((parts.widths > 1).all()):
                assert torch.equal(ids.long(), parts.block_ids(n))


# ---------------------------------------------------------------- interpreter
CASES = [  # n, causal, (BLOCK_M, BLOCK_N) under the interpreter, TMA descriptors or pointers, s
    (1, False, (32, 32), True, 3), (1, True, (32, 32), True, 3),
    (2, False, (32, 32), True, 3), (2, True, (32, 32), True, 3),
    (97, False, (64, 32), True, 3), (97, True, (64, 32), False, 3),
    (300, False, (128, 64), True, 2), (300, True, (64, 128), True, 2),
]
SIGMAS = torch.tensor([1.5, 6.0, 40.0, 400.0], dtype=torch.float64)


@pytest.mark.parametrize("n,causal,tiles,tma,s", CASES)
def test_interpreter_matches_reference(interpret, n, causal, tiles, tma, s):
    """B=2, GQA Hq=4 / Hkv=2; heads from tiny blocks (many per tile) to blocks
    longer than the tiles (interior tiles); both ways of loading tiles."""
    bm, bn = tiles
    interpret.setattr(_launch, "FORCE_TMA", tma)
    interpret.setitem(_launch.INTERPRET_BLOCKS, "fwd", (bm, bn))
    interpret.setitem(_launch.INTERPRET_BLOCKS, "dq", (bm, bn))
    interpret.setitem(_launch.INTERPRET_BLOCKS, "dkdv", (bn, bm))
    parts = poslsh.sample_partitions(SIGMAS, s, seed=7)
    if n > 64:   # the test covers both kinds of key tiles: interior (plain flash) and boundary (count)
        total, interior = _plan.visited_tiles(parts.widths, parts.offsets, n, bm, bn, causal)
        assert 0 < int(interior.sum()) < int(total.sum())
    q, k, v = _qkv(2, 4, 2, n, 16, dtype=torch.float32, seed=n)
    _check(q, k, v, parts, causal, FP32_TOL, f"interp n={n} causal={causal} tiles={tiles} tma={tma} s={s}")


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
    many = poslsh.sample_partitions(poslsh.alibi_sigmas(2), _launch.MAX_SAMPLES + 1, seed=0)
    with pytest.raises(ValueError, match="samples"):
        _launch.check_inputs(q, q, q, many.widths, many.offsets)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        _launch.check_inputs(q.double(), q.double(), q.double(), parts.widths, parts.offsets)
    with pytest.raises(ValueError, match="partitions"):
        one = poslsh.sample_partitions(poslsh.alibi_sigmas(1), 2, seed=0)
        _launch.check_inputs(q, q, q, one.widths, one.offsets)
    with pytest.raises(ValueError, match="tile sizes"):
        _launch._kernel_and_blocks("fwd", True, (24, 32))


def test_fake_and_meta_implementations():
    """Shapes/dtypes/strides from the fake kernels, with no kernel run (FakeTensorMode and meta)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, Hq, Hkv, n, d, dv = 2, 4, 2, 1000, 64, 32
    with FakeTensorMode():
        q = torch.empty(B, n, Hq, d, dtype=torch.bfloat16).transpose(1, 2)   # strided input
        k = torch.empty(B, Hkv, n, d, dtype=torch.bfloat16)
        v = torch.empty(B, Hkv, n, dv, dtype=torch.bfloat16)
        w = torch.empty(Hq, 10, dtype=torch.float64)
        out, lse = torch.ops.poslsh.triton_attention_fwd(q, k, v, w, w, True, 0.125)
        assert out.shape == (B, Hq, n, dv) and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert lse.shape == (B, Hq, n) and lse.dtype == torch.float32
        dq, dk, dvv = torch.ops.poslsh.triton_attention_bwd(out, q, k, v, out, lse, w, w, True, 0.125)
        assert dq.shape == q.shape and dq.is_contiguous() and dk.shape == k.shape and dvv.shape == v.shape
    meta = [torch.empty(s, device="meta", dtype=torch.float16) for s in ((1, 2, 77, 16), (1, 1, 77, 16))]
    w = torch.empty(2, 3, dtype=torch.float64, device="meta")
    out, lse = torch.ops.poslsh.triton_attention_fwd(meta[0], meta[1], meta[1], w, w, False, 0.25)
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
    torch._dynamo.reset()
    q, k, v = (x.requires_grad_() for x in _qkv(1, 2, 1, 24, 16, dtype=torch.float32, seed=9))
    parts = poslsh.sample_partitions(torch.tensor([2.0, 9.0], dtype=torch.float64), 2, seed=1)

    def loss(q, k, v):
        return pt.attention(q, k, v, parts, causal=True).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    lc = compiled(q, k, v)
    gc = torch.autograd.grad(lc, (q, k, v))
    le = loss(q, k, v)
    ge = torch.autograd.grad(le, (q, k, v))
    assert torch.allclose(lc, le)
    for a, b in zip(gc, ge):
        assert torch.allclose(a, b)


# ---------------------------------------------------------------- GPU
GPU_TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-4}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_matches_reference(dtype, causal, d):
    n = 1531 if d == 64 else 1024
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(4) * 4, 10, seed=0).to("cuda")
    q, k, v = _qkv(2, 4, 2, n, d, dtype=dtype, device="cuda", seed=d)
    _check(q, k, v, parts, causal, GPU_TOL[dtype], f"gpu {dtype} d={d} causal={causal}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_odd_head_dims_and_partitions():
    n = 777
    q, k, v = _qkv(1, 2, 1, n, 80, dv=96, dtype=torch.bfloat16, device="cuda", seed=2)
    _check(q, k, v, _odd_partitions().to("cuda"), True, GPU_TOL[torch.bfloat16], "gpu odd partitions d=80 dv=96")
    _check(q, k, v, Partitions.fixed_blocks(2, 256, device="cuda"), False, GPU_TOL[torch.bfloat16],
           "gpu fixed blocks")


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

    def attend(q, k, v):
        if path == "custom_op":
            return pt.attention(q, k, v, parts, causal=True)
        return poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="triton")

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
