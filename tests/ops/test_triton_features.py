"""The Triton backend's features beyond plain self-attention: the log-sum-exp (``return_lse``,
differentiable) and packed documents, for positional LSH (op ``"sequence"``); the registry's view
of them. Kernels run under the interpreter in float32 against the float64 oracles
(:mod:`poslsh.reference`), forward and backward (through the output and through the lse)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import poslsh  # noqa: E402
from poslsh.window import make_window  # noqa: E402
from poslsh.documents import make_documents  # noqa: E402
from poslsh.ops import registry  # noqa: E402
from poslsh.ops.triton import _launch, _plan  # noqa: E402
from inputs import assert_compiles_like_eager  # noqa: E402
from poslsh.partitions import Partitions  # noqa: E402

TOL = 2e-5
SIGMAS = torch.tensor([1.5, 6.0, 40.0, 400.0], dtype=torch.float64)
# awkward packing: 1-token documents first, inside and last; the second row packs differently
IDS = torch.tensor([[0] * 1 + [1] * 30 + [2] * 1 + [3] * 50 + [4] * 14 + [5] * 1, [0] * 60 + [1] * 37])


SMALL_TILES = True      # the interpret fixture (conftest.py) runs 32 x 32 tiles


def qkv(B, Hq, Hkv, n, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, d, generator=g) for h in (Hq, Hkv, Hkv)]


def _err(ours, ref) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1.0)).item()


def check_op(run, q, k, v, label, tol=TOL):
    """``run(q, k, v, backend) -> (out, lse)`` on ``"triton"`` (q.dtype) vs ``"reference"``
    (float64): out, lse, and dq / dk / dv of ``<out, dout> + <lse, dlse>`` (the gradient flows
    through both). Returns the errors."""
    g = torch.Generator().manual_seed(1)
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = run(*xs, "triton")
    assert lse.dtype == torch.float32 and lse.shape == out.shape[:3]
    dout, dlse = (torch.randn(t.shape, generator=g, dtype=torch.float64).to(q.device) for t in (out, lse))
    ((out * dout.to(out)).sum() + (lse * dlse.float()).sum()).backward()
    rs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    rout, rlse = run(*rs, "reference")
    ((rout * dout).sum() + (rlse * dlse).sum()).backward()
    errs = {"out": _err(out, rout), "lse": _err(lse, rlse),
            **{f"d{c}": _err(x.grad, r.grad) for c, x, r in zip("qkv", xs, rs)}}
    print(f"{label}: " + "  ".join(f"{m} {e:.1e}" for m, e in errs.items()))
    for m, e in errs.items():
        assert e < tol, f"{label}: {m} error {e:.2e} >= {tol}"
    return errs


# ---------------------------------------------------------------- lse
@pytest.mark.parametrize("n,causal", [(1, False), (2, True), (97, True), (97, False)])
def test_lse_and_its_gradient(interpret, n, causal):
    """``return_lse``: ``log sum_k count_ik e^{s_ik}`` (natural log, count not divided by s), and
    the gradient through it (``ds = p (dp - delta + dlse)``); GQA 4/2, batch 2, both count methods."""
    parts = poslsh.sample_partitions(SIGMAS, 3, seed=7)
    q, k, v = qkv(2, 4, 2, n, seed=n)
    check_op(lambda q, k, v, be: poslsh.poslsh_attention(q, k, v, parts, causal=causal, backend=be, return_lse=True),
             q, k, v, f"lse n={n} causal={causal}")


def test_lse_merges_disjoint_key_sets(interpret):
    """Two attentions over disjoint keys merge exactly with their lse: documents [0, 40) and
    [40, 97) run packed equal each run alone (same kernels, same partitions)."""
    parts = poslsh.sample_partitions(SIGMAS, 3, seed=2)
    q, k, v = qkv(1, 4, 2, 97, seed=3)
    out, lse = poslsh.poslsh_attention(q, k, v, parts, causal=True, backend="triton", return_lse=True,
                                       cu_seqlens=torch.tensor([0, 40, 97]))
    for a, b in ((0, 40), (40, 97)):
        o, l = poslsh.poslsh_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], parts, causal=True, backend="triton",
                                       return_lse=True)
        assert (out[:, :, a:b] - o).abs().max() < 1e-5 and (lse[:, :, a:b] - l).abs().max() < 1e-5


# ---------------------------------------------------------------- packed documents
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("r_max", [32, 8])
def test_documents(interpret, causal, r_max):
    """Packed documents (positions restart in each; the partition laid over each from its start):
    1-token documents, rows that pack differently (one plan per row), GQA 4/2; R_MAX = 8 sends
    every tile to the label-compare count, 32 mixes it with the one-hot count."""
    interpret.setitem(_launch.ONEHOT_MAX, "r_max", r_max)
    parts = poslsh.sample_partitions(SIGMAS, 3, seed=5)
    q, k, v = qkv(2, 4, 2, IDS.shape[1], seed=11)
    check_op(lambda q, k, v, be: poslsh.poslsh_attention(q, k, v, parts, causal=causal, backend=be, return_lse=True,
                                                         document_ids=IDS),
             q, k, v, f"documents causal={causal} R_MAX={r_max}")


@pytest.mark.parametrize("r_max", [8, 32])
def test_documents_grouped_partitions(interpret, r_max):
    """Grouped partitions (lattice counts) with packed documents: each document's lattice
    indices are shifted past the previous document's by at least the group size."""
    interpret.setitem(_launch.ONEHOT_MAX, "r_max", r_max)
    sig = torch.tensor([0.3, 1.5, 6.0, 40.0, 400.0, 1e6], dtype=torch.float64)
    parts = poslsh.sample_partitions(sig, 10, seed=3, sampler="grouped")
    q, k, v = qkv(2, 6, 2, IDS.shape[1], seed=4)
    check_op(lambda q, k, v, be: poslsh.poslsh_attention(q, k, v, parts, causal=True, backend=be, return_lse=True,
                                                         document_ids=IDS),
             q, k, v, f"documents grouped R_MAX={r_max}")


@pytest.mark.slow
def test_documents_long(interpret):
    """n = 1025, many documents of random lengths, non-causal, s = 4."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 200, (30,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    cu = torch.cat([cu[cu < 1025], torch.tensor([1025])])
    parts = poslsh.sample_partitions(SIGMAS * 4, 4, seed=1)
    q, k, v = qkv(1, 4, 4, 1025, seed=2)
    check_op(lambda q, k, v, be: poslsh.poslsh_attention(q, k, v, parts, causal=False, backend=be, return_lse=True,
                                                         cu_seqlens=cu),
             q, k, v, "documents n=1025")


def test_document_plan_is_each_document_alone():
    """The documents plan (plain torch): inside a document, labels are the document's own labels
    (block_labels of local positions) shifted by a constant; consecutive along the row (the
    kernels count a tile's blocks as a label range); never equal across documents; granule
    bounds are the document's blocks (``Partitions.blocks`` of the document alone) in packed
    indices. Rows packed alike share one plan row."""
    parts = Partitions(torch.tensor([[0.5, 7.0, 3.3], [100.0, 2.5, 9.0]], dtype=torch.float64),
                       torch.tensor([[0.1, 3.0, 0.2], [50.0, 1.0, 8.5]], dtype=torch.float64))
    n = IDS.shape[1]
    docs = make_documents(2, n, document_ids=IDS)
    p = _plan.document_plan(parts.widths, parts.offsets, n, 1, docs.start, docs.end)
    assert p.ids.shape == (2, 2, 3, n) and p.gran.shape == (2, 2, 2, 3, (n + 15) // 16)
    assert _plan.row_strides(p) == (p.ids[0].numel(), p.gran[0, 0].numel(), p.ids[0].numel())
    for row in range(2):
        ids = p.ids[row].long()
        step = ids[..., 1:] - ids[..., :-1]
        assert bool(((step == 0) | (step == 1)).all()) and bool((ids[..., 0] == 0).all())
        for a in torch.unique(docs.start[row]).tolist():
            b = int(docs.end[row, a])
            local = _plan.block_ids(parts.widths, parts.offsets, b - a).long()
            assert torch.equal(ids[..., a:b] - ids[..., a:a + 1], local - local[..., :1])
            if b < n:
                assert bool((ids[..., b] > ids[..., b - 1]).all())      # a new block at every document start
            start, end = _plan.block_bounds(parts.widths, parts.offsets, b - a, torch.arange(b - a))
            g = torch.arange(0, n, 16)
            inside = (g >= a) & (g < b)
            assert torch.equal(p.gran[0, row][..., inside].long(), a + start[..., g[inside] - a])
            last = (g + 15).clamp(max=n - 1)
            inside = (last >= a) & (last < b)
            assert torch.equal(p.gran[1, row][..., inside].long(), a + end[..., last[inside] - a])
    same = make_documents(2, n, document_ids=IDS[:1].expand(2, n))
    shared = _plan.document_plan(parts.widths, parts.offsets, n, 1, same.start, same.end)
    assert shared.ids.shape[0] == 1 and _plan.row_strides(shared) == (0, 0, 0)


def test_documents_plan_cached_for_the_backward(interpret):
    """A forward + backward builds the documents plan once (the backward finds it: the same
    documents tensor), and it does not outlive the documents."""
    parts = poslsh.sample_partitions(SIGMAS, 3, seed=5)
    q, k, v = (x.requires_grad_() for x in qkv(1, 4, 2, 40, seed=1))
    docs = make_documents(1, 40, cu_seqlens=torch.tensor([0, 7, 40]))
    _plan.CACHE.clear()
    builds = _plan.CACHE.builds
    out, _ = pt_attention(q, k, v, parts, docs)
    out.sum().backward()
    assert _plan.CACHE.builds == builds + 1 and len(_plan.CACHE) == 1
    del out, docs
    import gc
    gc.collect()
    assert len(_plan.CACHE) == 0


def pt_attention(q, k, v, parts, docs):
    from poslsh.ops.triton import attention
    return attention(q, k, v, parts, causal=True, return_lse=True, documents=docs)


# ---------------------------------------------------------------- registry, fakes, compile
def test_registered_features():
    """The "triton" backend serves both 1-D ops with packed documents and the lse, not spans
    (queries and keys at given positions): asking for them names what is missing."""
    poslsh.available_backends()
    tri = {b.name: b for b in registry.registered()}["triton"]
    assert tri.features == {"sequence": frozenset({"documents", "lse"}), "window": frozenset({"documents", "lse"})}
    assert tri.missing("sequence", {"spans"}) == [f"it does not support {registry.FEATURES['spans']}"]


def test_spans_are_refused_in_one_line(interpret):
    parts = poslsh.sample_partitions(SIGMAS, 2, seed=0)
    q = torch.zeros(1, 4, 8, 16)
    with pytest.raises(ValueError, match="backend='triton' cannot run this call: it does not support queries"):
        poslsh.poslsh_attention(q, q, q, parts, causal=True, backend="triton", q_start=4)


def test_fake_implementations_with_documents_and_window():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 4, 50, 32, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 50, 32, dtype=torch.bfloat16)
        v = torch.empty(2, 2, 50, 24, dtype=torch.bfloat16)
        st = torch.empty(2, 50, dtype=torch.int64)
        w = torch.empty(4, 3, dtype=torch.float64)
        out, lse, lo = torch.ops.poslsh.triton_attention_fwd(q, k, v, w, w, True, 0.2, None, st, st)
        assert out.shape == (2, 4, 50, 24) and lse.shape == lo.shape == (2, 4, 50)
        g = torch.ops.poslsh.triton_attention_bwd(out, q, k, v, out, lse, lo, w, w, True, 0.2, None, lse, st, st)
        assert [x.shape for x in g] == [q.shape, k.shape, v.shape]
        slopes, win = torch.empty(4, dtype=torch.float64), torch.empty(4, dtype=torch.int64)
        out, lse, lo = torch.ops.poslsh.triton_window_fwd(q, k, v, slopes, win, False, 0.2, st, st)
        assert out.shape == (2, 4, 50, 24) and lse.dtype == torch.float32
        g = torch.ops.poslsh.triton_window_bwd(out, q, k, v, out, lse, lo, slopes, win, False, 0.2, lse, st, st)
        assert [x.shape for x in g] == [q.shape, k.shape, v.shape]


def test_opcheck_with_lse_and_documents(interpret):
    q, k, v = qkv(1, 2, 1, 20, seed=8)
    parts = poslsh.sample_partitions(torch.tensor([2.0, 9.0], dtype=torch.float64), 2, seed=1)
    docs = make_documents(1, 20, cu_seqlens=torch.tensor([0, 1, 12, 20]))
    torch.library.opcheck(torch.ops.poslsh.triton_attention_fwd.default,
                          (q, k, v, parts.widths, parts.offsets, True, 0.25, None, docs.start, docs.end),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    win = make_window(poslsh.alibi_slopes(2), 5)
    torch.library.opcheck(torch.ops.poslsh.triton_window_fwd.default,
                          (q, k, v, win.slopes, win.window, False, 0.25, docs.start, docs.end),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_compile_fullgraph_with_lse(interpret):
    """torch.compile(fullgraph=True) (aot_eager) through both ops with return_lse: no graph break,
    the compiled gradients equal the eager ones."""
    from poslsh.ops.triton import attention, window_attention
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 1, 24, seed=9))
    parts = poslsh.sample_partitions(torch.tensor([2.0, 9.0], dtype=torch.float64), 2, seed=1)
    win = make_window(poslsh.alibi_slopes(2), 6)

    def loss(q, k, v):
        o1, l1 = attention(q, k, v, parts, causal=True, return_lse=True)
        o2, l2 = window_attention(q, k, v, win, causal=False, return_lse=True)
        return o1.square().sum() + l1.sum() + o2.square().sum() + l2.sin().sum()

    assert_compiles_like_eager(loss, q, k, v)
