"""Reproducible: identical calls of the torch backend give bitwise-identical outputs, lse and
gradients, and so do calls under 1, 2 and 3 threads (3: more threads than a small machine has
cores, so the chunks interleave). Every op: positional LSH (GQA, causal and not, packed documents), the
window op (finite and exact windows, packed documents, queries and keys at given positions) and
the 2-D op; small chunks, so that each call has many of them. Plus the mechanism itself
(:func:`poslsh.ops.torch.workers.run_items`): the gradient adds happen in one order whatever
order the chunks finish in, and every chunk runs with one intra-op thread."""
import threading

import pytest
import torch

import poslsh
from poslsh.attention import poslsh_attention_nd
from poslsh.ops.torch import band as torch_band, grid as torch_grid, ops as torch_impl, kernels as torch_kernels, tiles as torch_tiles, workers as torch_workers
from poslsh.partitions_nd import sample_partitions_nd
from poslsh.threads import intra_op_threads

from inputs import make_qkv

N = 1024
SLOPES = poslsh.alibi_slopes(4)
PARTS = poslsh.sample_partitions(torch.tensor([2.0, 8.0, 40.0, 300.0], dtype=torch.float64), 4, seed=1)
CU = torch.tensor([0, 1, 300, 301, 777, N])                   # packed documents, 1-token ones too


@pytest.fixture
def many_chunks(monkeypatch):
    """Small chunks (tens per call), the machine's load out of play; the item count of every call
    is recorded."""
    monkeypatch.setattr(torch_tiles, "CHUNK_ELEMENTS", 1 << 12)
    monkeypatch.setattr(torch_band, "CHUNK_ELEMENTS", 1 << 10)
    monkeypatch.setattr(torch_grid, "CHUNK_ELEMENTS", 1 << 12)
    monkeypatch.setattr(torch_kernels, "FEW_QUERIES_ELEMENTS", 1 << 8)       # a decoding step: a group per head
    monkeypatch.setattr(torch_impl, "SINGLE_THREAD_WHEN_BUSY", False)
    counts = []
    real = torch_workers.run_items

    def counting(items, *args, **kw):
        counts.append(len(items))
        return real(items, *args, **kw)

    for module in (torch_band, torch_kernels, torch_grid):
        monkeypatch.setattr(module, "run_items", counting)
    return counts


def _inputs(n=N, seed=0, q_rows=None):
    q, k, v = make_qkv(2, 4, 2, n, 8, seed=seed, dtype=torch.float32)
    if q_rows is not None:
        q = q[:, :, q_rows].contiguous()
    g = torch.Generator().manual_seed(seed + 1)
    dout, dlse = torch.randn(q.shape, generator=g), torch.randn(q.shape[:3], generator=g)
    return [x.requires_grad_() for x in (q, k, v)], dout, dlse


def _run(op, threads, with_lse=True):
    """out (and lse), dq, dk, dv of one forward + backward under ``threads`` torch threads."""
    (q, k, v), dout, dlse = op["inputs"]
    with intra_op_threads(threads):
        res = op["call"](q, k, v)
        out, lse = res if with_lse else (res, None)
        loss = (out * dout).sum() + ((lse * dlse).sum() if with_lse else 0)
        grads = torch.autograd.grad(loss, (q, k, v))
    return [out.detach(), *([lse.detach()] if with_lse else []), *grads]


def _assert_reproducible(op, counts, with_lse=True, many=8):
    labels = ["out", "lse", "dq", "dk", "dv"] if with_lse else ["out", "dq", "dk", "dv"]
    first = _run(op, 2, with_lse)
    assert max(counts) >= many                                # many chunks share the threads
    for name, again in [("the same call again", _run(op, 2, with_lse)), ("1 thread", _run(op, 1, with_lse)),
                        ("3 threads", _run(op, 3, with_lse))]:
        for label, a, b in zip(labels, first, again):
            assert torch.equal(a, b), f"{label}: {name} differs by {float((a - b).abs().max()):.1e}"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "cu_seqlens"])
def test_positional_lsh_is_bitwise_reproducible(many_chunks, causal, packed):
    extra = dict(cu_seqlens=CU) if packed else {}
    inputs = _inputs()
    if packed:                                                # cu_seqlens: one batch row
        (q, k, v), dout, dlse = inputs
        inputs = [[x.detach()[:1].requires_grad_() for x in (q, k, v)], dout[:1], dlse[:1]]
    op = dict(inputs=inputs, call=lambda q, k, v: poslsh.poslsh_attention(
        q, k, v, PARTS, causal=causal, backend="torch", return_lse=True, **extra))
    _assert_reproducible(op, many_chunks)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", ["windows", "exact", "documents", "spans", "decoding"])
def test_window_op_is_bitwise_reproducible(many_chunks, case, causal):
    window = torch.tensor([0, 5, 40, 200]) if case != "exact" else torch.full((4,), N + 3)
    extra, inputs = {}, _inputs()
    if case == "documents":
        extra = dict(document_ids=torch.stack([torch.bucketize(torch.arange(N), CU[1:], right=True),
                                               (torch.arange(N) >= 512).long()]))
    if case == "spans":                                       # queries [500, 800) against keys [300, N)
        inputs = _inputs(q_rows=slice(500, 800))
        (q, k, v), dout, dlse = inputs
        inputs = [[q, k.detach()[:, :, 300:].requires_grad_(), v.detach()[:, :, 300:].requires_grad_()], dout, dlse]
        extra = dict(q_start=500, k_start=300, seq_len=N)
    if case == "decoding":                                    # a few queries: one batched product forward,
        inputs = _inputs(q_rows=slice(N - 3, N))
        extra = dict(q_start=N - 3, seq_len=N)                # the backward's few items on the threads
    op = dict(inputs=inputs, call=lambda q, k, v: poslsh.windowed_alibi_attention(
        q, k, v, SLOPES, window=window, causal=causal, backend="torch", return_lse=True, **extra))
    _assert_reproducible(op, many_chunks, many=3 if case == "decoding" else 8)


@pytest.mark.parametrize("causal", [True, False])
def test_nd_op_is_bitwise_reproducible(many_chunks, causal):
    parts = sample_partitions_nd(torch.tensor([[0.6, 0.6], [2.0, 5.0], [6.0, 1.5], [20.0, 20.0]],
                                              dtype=torch.float64), 4, seed=2)
    op = dict(inputs=_inputs(), call=lambda q, k, v: poslsh_attention_nd(q, k, v, parts, grid=(32, 32),
                                                                        causal=causal, backend="torch"))
    _assert_reproducible(op, many_chunks, with_lse=False)


# ------------------------------------------------------------------ the mechanism
def test_adds_happen_in_one_order_whatever_order_the_items_finish_in():
    """On 6 threads the items finish in the reverse of their order (each waits for the next one to
    finish); their parts are still committed in the order of the items sorted by cost, biggest
    first (ties in the given order), as with 1 worker."""
    items = list(range(6))
    cost = lambda i: i % 3                                  # noqa: E731
    want = [2, 5, 1, 4, 0, 3]
    finished = {i: threading.Event() for i in items}

    def waiting(i):
        r = want.index(i)
        if r + 1 < len(want):                                # generous bound: a hang fails, nothing is timed
            assert finished[want[r + 1]].wait(timeout=600)
        finished[i].set()
        return i

    for workers, run in ((1, lambda i: i), (6, waiting)):
        done, commits = [], []
        torch_workers.run_items(items, lambda i: (run(i), done.append(i))[0], cost, workers=workers,
                                commit=lambda i, part: commits.append((i, part)))
        assert commits == [(i, i) for i in want]
        assert done == (want if workers == 1 else want[::-1])


def test_every_item_runs_with_one_intra_op_thread():
    """On the workers and inline (1 worker, or a single item while torch has 3 threads): a
    reduction split across threads would add in another order."""
    seen = []
    with intra_op_threads(3):
        for items, workers in (([0], None), (list(range(8)), 1), (list(range(8)), 3)):
            torch_workers.run_items(items, lambda i: seen.append(torch.get_num_threads()), lambda i: i,
                                    workers=workers, commit=lambda i, part: seen.append(torch.get_num_threads()))
        assert torch.get_num_threads() == 3                 # restored
    assert len(seen) == 2 * 17 and set(seen) == {1}


def test_a_failing_item_is_raised_and_stops_the_others():
    def run(i):
        if i == 3:
            raise ValueError("item 3")
        return i

    commits = []
    with pytest.raises(ValueError, match="item 3"):
        torch_workers.run_items(list(range(40)), run, lambda i: -i, workers=3,
                                commit=lambda i, part: commits.append(i))
    assert commits == list(range(len(commits))) and len(commits) <= 3
