"""Packed documents on the torch backend, both ops: a packed row equals its documents run one by
one (positions restart in every document) and the dense oracle, no key of another document gets
weight, and the packed plan costs exactly what the documents cost alone."""
import pytest
import torch

import poslsh
from poslsh.documents import make_documents
from poslsh.ops.torch import ops as torch_ops, tiles as torch_tiles
from poslsh.ops.torch.plan import Layout, Span
from poslsh.reference import alibi_attention_reference

from inputs import make_qkv

PARTS = poslsh.sample_partitions(poslsh.alibi_sigmas(4) * 2, 5, seed=3)
SLOPES = poslsh.alibi_slopes(4)
WINDOWS = torch.tensor([0, 2, 9, 1000])
# two rows packed differently, awkward lengths and 1-token documents (97 tokens each)
LENGTHS = [[1, 5, 1, 40, 1, 49], [60, 37]]


def _ids(lengths):
    return torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])


def _op(name):
    """The torch backend's call and the oracle of op ``name``, keyword arguments passed on."""
    if name == "sequence":
        return (lambda q, k, v, **kw: poslsh.poslsh_attention(q, k, v, PARTS, backend="torch", **kw),
                lambda q, k, v, **kw: poslsh.poslsh_attention_reference(q, k, v, PARTS, **kw))
    return (lambda q, k, v, **kw: poslsh.windowed_alibi_attention(q, k, v, SLOPES, window=WINDOWS, backend="torch",
                                                                   **kw),
            lambda q, k, v, **kw: alibi_attention_reference(q, k, v, SLOPES, window=WINDOWS, **kw))


def _max_err(xs, ys):
    return max(float((a - b).detach().abs().max()) for a, b in zip(xs, ys))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["sequence", "window"])
def test_packed_rows_equal_each_document_alone(name, causal):
    """Batch 2 packed differently (document_ids), GQA 4 / 2: out, lse and the gradients of a loss of
    both equal every document run alone (float64 rounding) and the dense oracle."""
    fast, oracle = _op(name)
    n = sum(LENGTHS[0])
    q, k, v = make_qkv(2, 4, 2, n, 8, seed=1, requires_grad=True)
    ids = torch.stack([_ids(lengths) for lengths in LENGTHS])
    w = torch.randn(2, 4, n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def loss(out, lse, rows=slice(None), cols=slice(None)):
        return (out * w[rows, :, cols]).sum() + lse.square().sum()

    out, lse = fast(q, k, v, causal=causal, document_ids=ids, return_lse=True)
    grads = torch.autograd.grad(loss(out, lse), (q, k, v))
    ref_out, ref_lse = oracle(q, k, v, causal=causal, document_ids=ids, return_lse=True)
    ref_grads = torch.autograd.grad(loss(ref_out, ref_lse), (q, k, v))
    alone_out, alone_lse, alone_loss = torch.zeros_like(out), torch.zeros_like(lse), 0
    for b, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            cols = slice(start, start + length)
            o, l = fast(*(x[b:b + 1, :, cols] for x in (q, k, v)), causal=causal, return_lse=True)
            alone_out[b, :, cols], alone_lse[b, :, cols] = o[0].detach(), l[0].detach()
            alone_loss = alone_loss + loss(o, l, slice(b, b + 1), cols)
            start += length
    alone_grads = torch.autograd.grad(alone_loss, (q, k, v))
    err_alone = _max_err([out, lse, *grads], [alone_out, alone_lse, *alone_grads])
    err_ref = _max_err([out, lse, *grads], [ref_out, ref_lse, *ref_grads])
    print(f"{name} causal={causal}: packed vs alone {err_alone:.1e}, vs oracle {err_ref:.1e}")
    assert err_alone < 1e-12 and err_ref < 1e-10


@pytest.mark.parametrize("name", ["sequence", "window"])
def test_cu_seqlens_equals_document_ids(name):
    fast, _ = _op(name)
    q, k, v = make_qkv(1, 4, 2, 97, 8, seed=4)
    cu = torch.tensor([0, 1, 6, 7, 47, 48, 97])
    a = fast(q, k, v, causal=True, cu_seqlens=cu)
    b = fast(q, k, v, causal=True, document_ids=_ids(LENGTHS[0])[None])
    assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["sequence", "window"])
def test_no_weight_across_documents(name, causal):
    """A query's out and lse have exactly zero gradient w.r.t. keys and values of other documents, and
    every finite bias of every chunk of the packed plan pairs a query and a key of one document."""
    fast, _ = _op(name)
    lengths = LENGTHS[0]
    n = sum(lengths)
    ids = _ids(lengths)
    q, k, v = make_qkv(1, 4, 2, n, 8, seed=5, requires_grad=True)
    out, lse = fast(q, k, v, causal=causal, document_ids=ids[None], return_lse=True)
    for i in (0, 1, 6, 46, 47, 96):                  # 1-token documents, first and last tokens
        gk, gv = torch.autograd.grad(out[:, :, i].sum() + lse[:, :, i].sum(), (k, v), retain_graph=True)
        other = ids != ids[i]
        assert bool((gk[:, :, other] == 0).all()) and bool((gv[:, :, other] == 0).all())
        assert bool((gv[:, :, ~other] != 0).any())
    docs = make_documents(1, n, document_ids=ids[None])
    a, b = (PARTS.widths, PARTS.offsets) if name == "sequence" else (SLOPES, WINDOWS)
    layout = Layout(docs.start[0], docs.end[0])
    plan = torch_ops.make_plan(name, a, b, Span.self_attention(n), layout, causal, "cpu")
    shape = torch_ops._shape(q, k, v)
    checked = 0
    for c in torch_tiles.iter_chunks(plan.groups, plan.bounds, shape, torch.float64, plan.slopes):
        q_rows = (c.rows % n).view(c.units, c.tile, 1)
        k_rows = (c.kv_rows % n).view(c.units, 1, c.width)
        seen = torch.isfinite(c.bias)
        real = (c.out_rows < 4 * n).view(c.units, c.tile, 1)       # rows that are written
        assert bool((ids[q_rows] == ids[k_rows])[seen & real].all())
        checked += int((seen & real).sum())
    assert checked > n


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["sequence", "window"])
def test_packed_plan_costs_what_the_documents_cost_alone(name, causal):
    """Long-tailed lengths: the packed plan computes exactly as many scores as the documents' own
    plans together (tiles restart at every document, no tile mixes two)."""
    lengths = [1, 3, 700, 2, 1500, 17, 1, 64, 129, 5, 300]
    n = sum(lengths)
    docs = make_documents(1, n, document_ids=_ids(lengths)[None])
    a, b = (PARTS.widths, PARTS.offsets) if name == "sequence" else (SLOPES, torch.tensor([0, 16, 100, 5000]))
    packed = torch_ops.make_plan(name, a, b, Span.self_attention(n), Layout(docs.start[0], docs.end[0]), causal, "cpu")
    alone = sum(torch_tiles.score_elements(torch_ops.make_plan(name, a, b, Span.self_attention(m), None, causal,
                                                                "cpu").groups) for m in lengths)
    unpacked = torch_tiles.score_elements(torch_ops.make_plan(name, a, b, Span.self_attention(n), None, causal,
                                                               "cpu").groups)
    packed = torch_tiles.score_elements(packed.groups)
    print(f"{name} causal={causal}: scores packed {packed}, documents alone {alone}, unpacked row {unpacked}")
    assert packed == alone and packed < unpacked


def test_rows_packed_alike_share_one_plan(monkeypatch):
    """Rows 0 and 2 pack alike, row 1 differently: two plans, and each row equals the row run alone."""
    n = 97
    ids = torch.stack([_ids(LENGTHS[0]), _ids(LENGTHS[1]), _ids(LENGTHS[0]) + 7])
    docs = make_documents(3, n, document_ids=ids)
    assert len(torch_ops._packings(docs.start, docs.end)) == 2
    q, k, v = make_qkv(3, 4, 2, n, 8, seed=6)
    fast, _ = _op("sequence")
    out = fast(q, k, v, causal=True, document_ids=ids)
    for b in range(3):
        one = fast(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal=True, document_ids=ids[b:b + 1])
        assert _max_err([out[b:b + 1]], [one]) < 1e-13


@pytest.mark.parametrize("name", ["sequence", "window"])
def test_few_queries_path_with_documents(name, monkeypatch):
    """12 tokens in documents of 1, 4 and 7 (the few-queries path) equal the tiled path and the oracle."""
    fast, oracle = _op(name)
    ids = _ids([1, 4, 7])[None]
    q, k, v = make_qkv(1, 4, 2, 12, 8, seed=7)
    few = fast(q, k, v, causal=False, document_ids=ids, return_lse=True)
    monkeypatch.setattr(torch_ops, "FEW_QUERIES", 0)
    tiled = fast(q, k, v, causal=False, document_ids=ids, return_lse=True)
    ref = oracle(q, k, v, causal=False, document_ids=ids, return_lse=True)
    assert _max_err(few, tiled) < 1e-13 and _max_err(few, ref) < 1e-12


def test_documents_are_for_self_attention():
    q, k, v = make_qkv(1, 4, 2, 10, 8)
    with pytest.raises(ValueError, match="packed documents are for self-attention"):
        poslsh.poslsh_attention(q, k, v, PARTS, causal=True, q_start=3, cu_seqlens=torch.tensor([0, 4, 10]),
                                backend="torch")


def test_documents_checked_eagerly_with_their_values():
    q, k, v = make_qkv(2, 4, 2, 6, 8)
    with pytest.raises(ValueError, match=r"document_ids: row 1 has a document whose tokens are not contiguous"):
        poslsh.poslsh_attention(q, k, v, PARTS, document_ids=torch.tensor([[0, 0, 1, 1, 2, 2], [0, 1, 0, 2, 2, 2]]))
    with pytest.raises(ValueError, match=r"never decrease .* got \[0, 4, 2, 6\]"):
        poslsh.poslsh_attention(q[:1], k[:1], v[:1], PARTS, cu_seqlens=torch.tensor([0, 4, 2, 6]))
    # empty documents (repeated offsets, also at the end) start nothing
    a = make_documents(1, 6, cu_seqlens=torch.tensor([0, 0, 2, 2, 6, 6]))
    assert a.start.tolist() == [[0, 0, 2, 2, 2, 2]] and a.end.tolist() == [[2, 2, 6, 6, 6, 6]]


@pytest.mark.parametrize("name", ["sequence", "window"])
def test_documents_under_fullgraph_compile(name):
    """torch.compile(fullgraph=True) with cu_seqlens and document_ids: the checks on their values are
    runtime asserts with the same messages (no data-dependent guard), the result the eager one."""
    fast, _ = _op(name)
    poslsh.available_backends()
    q, k, v = make_qkv(2, 4, 2, 97, 8)
    ids = torch.stack([_ids(x) for x in LENGTHS])
    cu = torch.tensor([0, 1, 6, 7, 47, 48, 97])
    torch._dynamo.reset()
    run = torch.compile(lambda q, k, v, kw: fast(q, k, v, causal=True, **kw), fullgraph=True, backend="aot_eager")
    assert _max_err([run(q, k, v, dict(document_ids=ids))], [fast(q, k, v, causal=True, document_ids=ids)]) == 0
    assert _max_err([run(q[:1], k[:1], v[:1], dict(cu_seqlens=cu))],
                    [fast(q[:1], k[:1], v[:1], causal=True, cu_seqlens=cu)]) == 0
    with pytest.raises(RuntimeError, match="cu_seqlens must start at 0, never decrease and end at the sequence"):
        run(q[:1], k[:1], v[:1], dict(cu_seqlens=torch.tensor([0, 1, 6, 5, 47, 48, 97])))
    with pytest.raises(RuntimeError, match="cu_seqlens must start at 0"):
        run(q[:1], k[:1], v[:1], dict(cu_seqlens=torch.tensor([0, 1, 6, 7, 47, 48, 96])))
    bad = ids.clone()
    bad[1, -1] = 0
    with pytest.raises(RuntimeError, match="document_ids: a row has a document whose tokens are not contiguous"):
        run(q, k, v, dict(document_ids=bad))
