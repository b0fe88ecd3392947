"""The ``"flex"`` backend (PyTorch FlexAttention) against the dense float64 oracles.

On CPU FlexAttention runs forward only: its eager path (dense scores, the ``mask_mod`` and
``score_mod`` alone) and, under ``torch.compile``, inductor's CPU kernels that walk the
block lists. Both are checked against :func:`poslsh.poslsh_attention_reference` and
:func:`alibi_attention_reference` (float32 inputs; errors ``max |ours - ref| / max(max |ref|, 1)``
~1e-7, bound 2e-5); the block lists themselves are checked pair by pair against the dense
geometry. GPU tests (``-m gpu``) add the backward, bf16 and the lse gradient.
"""
import pytest
import torch

import poslsh
from poslsh.ops import flex, registry
from poslsh.partitions import Partitions, block_labels
from poslsh.reference import alibi_attention_reference

from inputs import make_qkv

pytestmark = pytest.mark.skipif(not flex.AVAILABLE, reason="this torch has no FlexAttention")
TOL = 2e-5
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _err(ours, ref) -> float:
    ref = ref.detach().double()
    return float((ours.detach().double().cpu() - ref.cpu()).abs().max() / ref.abs().max().clamp_min(1.0))


def _odd_partitions():
    """Widths from below 1 (every position its own block) to far beyond n, grouped samples too."""
    w = torch.tensor([[0.3, 1.0, 2.5, 5.5], [1e9, 2.0, 64.0, 7.25], [3.0, 3.0, 3.0, 3.0], [40.0, 9.0, 700.0, 1.5]],
                     dtype=torch.float64)
    return Partitions(w, w * torch.tensor([0.2, 0.9, 0.5, 0.99], dtype=torch.float64))


def _documents(kind, B, n):
    if kind is None:
        return {}
    if kind == "cu":
        cuts = sorted({0, n, *[min(n, x) for x in (1, n // 3, n // 3 + 1, n - 2)]})
        return {"cu_seqlens": torch.tensor(cuts)}
    ids = torch.zeros(B, n, dtype=torch.int64)
    for b in range(B):                        # every row packs differently
        for i, cut in enumerate(sorted({min(n, c) for c in (n // 4 + b, n // 2, n - 1 - b)})):
            ids[b, cut:] = i + 1
    return {"document_ids": ids}


CASES = [  # n, B, Hq, Hkv, causal, partitions, documents
    (1, 1, 4, 2, True, "alibi", None), (1, 2, 4, 4, False, "odd", None),
    (97, 2, 4, 2, True, "alibi", None), (97, 1, 4, 1, False, "odd", None), (97, 2, 4, 2, False, "grouped", None),
    (97, 1, 4, 2, True, "odd", "cu"), (97, 2, 4, 4, False, "alibi", "ids"),
    (1025, 2, 4, 2, True, "alibi", None), (1025, 1, 4, 2, False, "grouped", "ids"),
    pytest.param(4096, 1, 2, 1, True, "alibi", None, marks=pytest.mark.slow),
    pytest.param(4096, 1, 2, 2, False, "grouped", "cu", marks=pytest.mark.slow),
]


def _parts(kind, H, seed):
    if kind == "odd":
        return _odd_partitions()
    stretch = 4.0 if kind == "alibi" else 2.0
    return poslsh.sample_partitions(poslsh.alibi_sigmas(H) * stretch, 6, seed=seed,
                                    sampler="grouped" if kind == "grouped" else "iid")


@pytest.mark.parametrize("n,B,Hq,Hkv,causal,kind,docs", CASES)
def test_forward_matches_oracle(n, B, Hq, Hkv, causal, kind, docs):
    """Positional LSH and windowed ALiBi: out and lse equal the float64 oracles (eager flex)."""
    parts = _parts(kind, Hq, seed=n)
    q, k, v = make_qkv(B, Hq, Hkv, n, 16, dtype=torch.float32, seed=n)
    if docs == "cu":
        q, k, v = q[:1], k[:1], v[:1]
    kw = _documents(docs, q.shape[0], n)
    qd, kd, vd = q.double(), k.double(), v.double()
    out, lse = poslsh.poslsh_attention(q, k, v, parts, causal=causal, backend="flex", return_lse=True, **kw)
    ref, ref_lse = poslsh.poslsh_attention_reference(qd, kd, vd, parts, causal=causal, return_lse=True, **kw)
    slopes, window = poslsh.alibi_slopes(Hq), torch.tensor([0, 3, 40, 10 ** 6][:Hq])
    wout, wlse = poslsh.windowed_alibi_attention(q, k, v, slopes, window=window, causal=causal, backend="flex",
                                                 return_lse=True, **kw)
    wref, wref_lse = alibi_attention_reference(qd, kd, vd, slopes, window=window, causal=causal, return_lse=True, **kw)
    errs = {"out": _err(out, ref), "lse": _err(lse, ref_lse), "window out": _err(wout, wref),
            "window lse": _err(wlse, wref_lse)}
    print(f"flex n={n} B={B} {Hq}/{Hkv} causal={causal} {kind} docs={docs}: "
          + ", ".join(f"{k_} {e:.1e}" for k_, e in errs.items()))
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (q.shape[0], Hq, n)
    assert max(errs.values()) < TOL


@pytest.mark.parametrize("n,causal,op", [(300, True, "sequence"),
                                         pytest.param(300, False, "window", marks=pytest.mark.slow),
                                         pytest.param(1025, True, "window", marks=pytest.mark.slow)])
def test_under_torch_compile_matches_oracle(n, causal, op):
    """Inside a caller's torch.compile flex becomes inductor's kernels, which walk the block
    lists (3+ query tiles here): the same result as the oracle, GQA 4/2, batch 2."""
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(4) * 4, 6, seed=1)
    slopes = poslsh.alibi_slopes(4)
    q, k, v = make_qkv(2, 4, 2, n, 16, dtype=torch.float32, seed=2)
    if op == "sequence":
        fn = lambda q, k, v: poslsh.poslsh_attention(q, k, v, parts, causal=causal, backend="flex")  # noqa: E731
        ref = poslsh.poslsh_attention_reference(q.double(), k.double(), v.double(), parts, causal=causal)
    else:
        fn = lambda q, k, v: poslsh.windowed_alibi_attention(q, k, v, slopes, window=150, causal=causal,  # noqa: E731
                                                             backend="flex")
        ref = alibi_attention_reference(q.double(), k.double(), v.double(), slopes, window=150, causal=causal)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn)(q, k, v)
    e = _err(out, ref)
    print(f"flex compiled {op} n={n} causal={causal}: {e:.1e}")
    assert e < TOL


def _dense_lists(blocks, KB):
    """(partial, full) bool ``[B|1, H, QB, KB]`` from the BlockMask tensors."""
    out = []
    for num, idx in ((blocks[0], blocks[1]), (blocks[2], blocks[3])):
        dense = torch.zeros(*idx.shape[:-1], KB + 1, dtype=torch.bool)
        j = torch.arange(idx.shape[-1])
        dense.scatter_(-1, torch.where(j < num[..., None].long(), idx.long(), KB), True)
        out.append(dense[..., :KB])
    return out


@pytest.mark.parametrize("n", [1, 17, 100, 257])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("docs", [None, "ids"])
def test_block_lists_cover_exactly(monkeypatch, n, causal, docs):
    """With 16-position tiles: every pair with weight lies in a listed key block of its query
    tile, every listed block holds such a pair (no wasted block), and a block is *full* (no
    mask_mod) exactly when the mask_mod is true on all of its pairs; partial and full disjoint."""
    monkeypatch.setattr(flex, "BLOCK", 16)
    B, Hq = 2, 4
    documents = None
    if docs:
        from poslsh.documents import make_documents
        documents = make_documents(B, n, document_ids=_documents(docs, B, n)["document_ids"])
        same = documents.start[:, :, None] == documents.start[:, None, :]              # [B, n, n]
        pos = documents.positions().double()
    else:
        same, pos = torch.ones(1, n, n, dtype=torch.bool), torch.arange(n, dtype=torch.float64)[None]
    allowed = same[:, None] & (torch.ones(n, n, dtype=torch.bool).tril() if causal else True)   # the mask_mod
    parts = _odd_partitions()
    count = torch.stack([(lab[:, :, :, None] == lab[:, :, None, :]).sum(1)
                         for lab in (block_labels(parts.widths, parts.offsets, p) for p in pos)])   # [B|1, H, n, n]
    window = torch.tensor([0, 3, 20, 10 ** 6])
    dist = (torch.arange(n)[:, None] - torch.arange(n)[None]).abs()
    plans = [("sequence", flex._sequence_plan(parts, n, causal, documents, "cpu"), allowed, (count > 0) & allowed),
             ("window", flex._window_plan(poslsh.window.make_window(poslsh.alibi_slopes(Hq), window), n, causal,
                                          documents, "cpu"),
              allowed & (dist <= window[:, None, None]), allowed & (dist <= window[:, None, None]))]
    T = 16
    QB = KB = -(-n // T)
    pad = QB * T - n
    for name, plan, mask, support in plans:
        partial, full = _dense_lists(plan.blocks, KB)
        tiles = lambda x: torch.nn.functional.pad(x, (0, pad, 0, pad)).view(*x.shape[:-2], QB, T, KB, T)  # noqa: E731
        inside = tiles(torch.ones(1, 1, n, n, dtype=torch.bool))                      # real pairs of each block
        has_support = tiles(support.expand(-1, Hq, -1, -1)).any(-1).any(-2)          # [B, H, QB, KB]
        all_masked_in = (tiles(mask.expand(-1, Hq, -1, -1)) | ~inside).all(-1).all(-2)
        listed = partial | full
        print(f"{name} n={n} causal={causal} docs={docs}: {int(listed.sum())} blocks listed, {int(full.sum())} full, "
              f"{int(has_support.sum())} with weight")
        assert not bool((partial & full).any()), f"{name}: a block is both partial and full"
        assert torch.equal(listed.expand_as(has_support), has_support), f"{name}: listed blocks != blocks with weight"
        assert torch.equal(full.expand_as(has_support), (listed & all_masked_in).expand_as(has_support)), \
            f"{name}: full blocks != listed blocks with the mask_mod true everywhere"


def test_registry_and_auto():
    """Registered for both ops with documents and lse, not spans; below the fused kernel and
    never preferred for CPU tensors (auto keeps the torch backend there)."""
    seq = {b.name: b for b in registry.registered("sequence")}
    assert "flex" in seq and "flex" in {b.name for b in registry.registered("window")}
    assert seq["flex"].features["sequence"] == {"documents", "lse"} == seq["flex"].features["window"]
    if "triton" in seq:
        assert seq["triton"].priority > seq["flex"].priority
    assert seq["flex"].priority > seq["torch"].priority
    q = torch.zeros(1, 4, 8, 16)
    assert not seq["flex"].preferred(q)
    for needs in ((), ("lse",), ("documents", "lse")):               # flex is named only, never auto, on CPU
        assert registry.resolve("auto", "sequence", q, needs).name == "torch"
        assert registry.resolve("auto", "window", q, needs).name == "torch"
    assert "flex" in poslsh.available_backends(q) and "flex" not in poslsh.available_backends(q.double())
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(4), 2, seed=0)
    with pytest.raises(ValueError, match=r"backend='flex' cannot run.*float64"):
        poslsh.poslsh_attention(q.double(), q.double(), q.double(), parts, backend="flex")
    with pytest.raises(ValueError, match=r"backend='flex' cannot run.*q_start"):
        poslsh.poslsh_attention(q, q, q, parts, causal=True, q_start=3, backend="flex")


def test_cpu_backward_is_refused_in_one_line():
    """The forward runs with inputs that require grad; a backward through it raises, naming
    backend='torch' (FlexAttention has no CPU backward); no_grad and plain inputs work."""
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(2), 3, seed=0)
    q, k, v = make_qkv(1, 2, 2, 33, 16, dtype=torch.float32, requires_grad=True)
    out, lse = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="flex", return_lse=True)
    ref = poslsh.poslsh_attention_reference(q.detach().double(), k.detach().double(), v.detach().double(), parts,
                                            causal=True)
    assert _err(out, ref) < TOL and out.requires_grad and lse.requires_grad
    for loss in (out.sum(), lse.sum()):
        with pytest.raises(RuntimeError, match=r"no backward on CPU.*backend='torch'"):
            loss.backward()
    with torch.no_grad():
        assert _err(poslsh.windowed_alibi_attention(q, k, v, poslsh.alibi_slopes(2), window=5, backend="flex"),
                    alibi_attention_reference(q.double(), k.double(), v.double(), poslsh.alibi_slopes(2), window=5)) < TOL


def test_plan_is_cached_per_partitions_and_rebuilt_after_a_change():
    """Plans are cached per partitions; on CPU the call is compiled once per shape: new partitions
    of the same shape (a new plan) reuse the compiled kernels."""
    from torch._dynamo.utils import counters

    flex.CACHE.clear()
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(2), 3, seed=0)
    q, k, v = make_qkv(1, 2, 2, 200, 16, dtype=torch.float32)      # > 128 queries: compiled on CPU
    a = poslsh.poslsh_attention(q, k, v, parts, backend="flex")
    assert len(flex.CACHE._plans) == 1
    compiled = counters["stats"]["unique_graphs"]
    b = poslsh.poslsh_attention(q, k, v, parts, backend="flex")
    poslsh.windowed_alibi_attention(q, k, v, poslsh.alibi_slopes(2), window=4, backend="flex")
    poslsh.windowed_alibi_attention(q, k, v, poslsh.alibi_slopes(2), window=4, backend="flex")
    assert len(flex.CACHE._plans) == 2 and torch.equal(a, b)
    parts.widths.mul_(3)                      # in place: a new plan, a new result
    c = poslsh.poslsh_attention(q, k, v, parts, backend="flex")
    assert len(flex.CACHE._plans) == 3 and not torch.equal(a, c)
    assert _err(c, poslsh.poslsh_attention_reference(q.double(), k.double(), v.double(), parts)) < TOL
    other = poslsh.sample_partitions(poslsh.alibi_sigmas(2), 3, seed=5)
    poslsh.poslsh_attention(q, k, v, other, backend="flex")
    # one more graph: the window op's (its first call above); none for new partitions
    assert counters["stats"]["unique_graphs"] == compiled + 1
    flex.CACHE.clear()


# ---------------------------------------------------------------- GPU
def _check_gpu(fn, ref_fn, q, k, v, tol, label):
    """Forward and backward (through out and the lse) vs the float64 oracle."""
    x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*x)
    g = torch.Generator(device=q.device).manual_seed(1)
    dout = torch.randn(out.shape, generator=g, device=q.device)
    dlse = torch.randn(lse.shape, generator=g, device=q.device)
    ((out.float() * dout).sum() + (lse * dlse).sum()).backward()
    xd = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = ref_fn(*xd)
    ((ref * dout.double()).sum() + (ref_lse * dlse.double()).sum()).backward()
    errs = {"out": _err(out, ref), "lse": _err(lse, ref_lse),
            **{f"d{n_}": _err(a.grad, b.grad) for n_, a, b in zip("qkv", x, xd)}}
    print(f"{label}: " + "  ".join(f"{k_} {e:.2e}" for k_, e in errs.items()))
    for k_, e in errs.items():
        assert e < tol, f"{label}: {k_} error {e:.2e} >= {tol}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_gpu_sequence_forward_backward(dtype, tol):
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(4) * 4, 10, seed=0).to("cuda")
    q, k, v = (t.to("cuda", dtype) for t in make_qkv(2, 4, 2, 1025, 64, dtype=torch.float32, seed=3))
    _check_gpu(lambda q, k, v: poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="flex", return_lse=True),
               lambda q, k, v: poslsh.poslsh_attention_reference(q, k, v, parts, causal=True, return_lse=True),
               q, k, v, tol, f"gpu flex sequence {dtype}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_window_and_documents_forward_backward():
    slopes = poslsh.alibi_slopes(4)
    window = torch.tensor([0, 3, 40, 10 ** 6])
    q, k, v = (t.to("cuda", torch.bfloat16) for t in make_qkv(1, 4, 2, 1025, 64, dtype=torch.float32, seed=4))
    cu = torch.tensor([0, 300, 301, 1025], device="cuda")
    _check_gpu(lambda q, k, v: poslsh.windowed_alibi_attention(q, k, v, slopes, window=window, causal=True,
                                                               backend="flex", return_lse=True, cu_seqlens=cu),
               lambda q, k, v: alibi_attention_reference(q, k, v, slopes, window=window, causal=True, return_lse=True,
                                                      cu_seqlens=cu),
               q, k, v, 2e-2, "gpu flex window + documents bf16")


@pytest.mark.gpu
@needs_cuda
def test_gpu_auto_prefers_the_fused_kernel():
    """On CUDA "auto" takes triton when it can serve the call, flex before the torch backend."""
    q = torch.zeros(1, 4, 8, 64, device="cuda", dtype=torch.bfloat16)
    names = [b.name for b in registry.registered("sequence") if b.preferred(q) and b.can_run(q)]
    assert "flex" in names and names.index("flex") < names.index("torch")
    chosen = registry.resolve("auto", "sequence", q).name
    assert chosen == ("triton" if "triton" in names else "flex")
