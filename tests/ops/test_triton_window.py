"""The Triton kernels of the window op (:func:`poslsh.windowed_alibi_attention`, exact ALiBi
cut at per-head windows ``|i - j| <= w_h``, bias ``-m_h |i - j|``): under the interpreter in
float32 against the float64 oracle :func:`poslsh.reference.alibi_attention` (``window=``),
forward, lse and backward (through both), GQA, causal and not, windows 0 and >= n, packed
documents; compile-only checks for sm_90; a GPU test."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import poslsh  # noqa: E402
from poslsh.ops.triton import _config, _launch  # noqa: E402
from test_triton_features import IDS, check_op, qkv  # noqa: E402

SLOPES = poslsh.alibi_slopes(4)


SMALL_TILES = True      # the interpret fixture (conftest.py) runs 32 x 32 tiles


def _run(slopes, window, causal, **kw):
    return lambda q, k, v, be: poslsh.windowed_alibi_attention(q, k, v, slopes, window=window, causal=causal,
                                                               backend=be, return_lse=True, **kw)


@pytest.mark.parametrize("n,causal,batch", [(1, False, 2), (2, True, 1), (97, True, 2), (97, False, 1),
                                            pytest.param(257, True, 1, marks=pytest.mark.slow),
                                            pytest.param(257, False, 2, marks=pytest.mark.slow)])
def test_window_matches_reference(interpret, n, causal, batch):
    """Per-head windows 0 (a query sees itself), 5, 40 and >= n (exact ALiBi), GQA 4/2."""
    window = torch.tensor([0, 5, 40, n + 3])
    q, k, v = qkv(batch, 4, 2, n, seed=n)
    check_op(_run(SLOPES, window, causal), q, k, v, f"window n={n} causal={causal} B={batch}")


def test_window_wider_than_tiles_and_steep_slopes(interpret):
    """One window for every head spanning several key tiles (and not a multiple of them), slopes
    from 0 (no bias: plain attention in the window) to 4 (the far keys underflow), MQA, d = 24."""
    slopes = torch.tensor([0.0, 0.01, 4.0], dtype=torch.float64)
    q, k, v = qkv(1, 3, 1, 130, d=24, seed=5)
    for causal in (False, True):
        check_op(_run(slopes, 45, causal), q, k, v, f"window 45 causal={causal}")


def test_window_zero_is_the_value(interpret):
    """Window 0 for every head: each query attends to itself only, out = v, lse = scale q.k."""
    q, k, v = qkv(1, 2, 2, 40, seed=2)
    out, lse = poslsh.windowed_alibi_attention(q, k, v, SLOPES[:2], window=0, backend="triton", return_lse=True)
    assert torch.allclose(out, v, atol=1e-6)
    assert torch.allclose(lse, (q * k).sum(-1) / 4.0, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_window_documents(interpret, causal):
    """Packed documents: the window is cut at every document edge (positions restart in each);
    1-token documents, rows that pack differently."""
    q, k, v = qkv(2, 4, 2, IDS.shape[1], seed=13)
    check_op(_run(SLOPES, torch.tensor([0, 3, 20, 500]), causal, document_ids=IDS), q, k, v,
             f"window documents causal={causal}")


def test_window_float16(interpret):
    q, k, v = (x.half() for x in qkv(1, 2, 1, 50, seed=12))
    check_op(_run(SLOPES[:2], torch.tensor([7, 60]), True), q, k, v, "window fp16", tol=5e-3)


@pytest.mark.parametrize("name", ["wfwd", pytest.param("wdkdv", marks=pytest.mark.slow),
                                  pytest.param("wdq", marks=pytest.mark.slow)])
def test_window_kernels_compile_for_sm90(name):
    """Compile-only (no GPU): the window kernels' first configuration lowers for sm_90 (bf16,
    d = 128, causal, TMA), within the shared-memory model and with little spilling, with and
    without packed documents."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import triton_static
    fn = getattr(_launch.kernels(False), _launch.KERNEL_FNS[name])
    c = _config.CONFIGS[name][0]
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    for docs in (False, True):
        consts = dict(CAUSAL=True, D=128, DV=128, HEAD_DIM=128, HEAD_DV=128, USE_TMA=True, DOT_PREC="tf32",
                      HAS_DOCS=docs, BLOCK_M=bm, BLOCK_N=bn)
        r = triton_static.compile_sm90(fn, triton_static._types(fn, "bf16"), consts, c.num_warps, c.num_stages,
                                       triton_static._aligned(fn))
        print(name, "documents" if docs else "", r)
        assert r["smem"] <= _config.smem_estimate(name, bm, bn, c.num_stages, 128, 128, 2)
        assert r["spill_st"] <= 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,causal,docs", [(torch.bfloat16, True, False), (torch.bfloat16, False, True),
                                               (torch.float32, True, True)])
def test_gpu_window_matches_reference(dtype, causal, docs):
    """Compiled window kernels, n = 1025, 8 ALiBi heads (GQA 8/2), d = 64, windows 0 .. > n."""
    n = 1025
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, n, 64, generator=g).to("cuda", dtype) for h in (8, 2, 2))
    window = torch.tensor([0, 1, 7, 30, 100, 333, 1024, 5000])
    kw = {}
    if docs:
        ids = torch.zeros(2, n, dtype=torch.long)
        ids[0, 1:] = 1
        ids[0, 600:] = 2
        ids[1, 900:] = 1
        kw["document_ids"] = ids.cuda()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    check_op(_run(poslsh.alibi_slopes(8).cuda(), window.cuda(), causal, **kw), q, k, v,
             f"gpu window {dtype} causal={causal} docs={docs}", tol=tol)
