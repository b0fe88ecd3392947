"""Streaming decoding with a bounded KV cache (poslsh.decoding), against the dense float64 oracle:
positional LSH and the ALiBi window, one stream and the documents of a packed prefill."""
import math

import pytest
import torch

import poslsh
from poslsh.reference import alibi_attention_reference
from poslsh.window import make_window
from poslsh.decoding import (KVWindow, attend, cache_bound, cache_bound_whp, document_rows, first_needed,
                             packed_windows)

WINDOW_AND_DOCUMENTS_BACKEND = "torch"


def narrow_and_wide(s=4, seed=0):
    """Two heads: sigma 2 (blocks of a few tokens) and 150 (blocks of hundreds)."""
    return poslsh.sample_partitions(torch.tensor([2.0, 150.0], dtype=torch.float64), s, seed=seed)


def test_first_needed_is_exactly_the_first_key_any_later_query_sees():
    parts, n = narrow_and_wide(), 1200
    count = parts.dense_count(n)                                   # [H, n, n] oracle
    later = count.flip(1).cummax(1).values.flip(1) > 0             # [H, p, j]: some query >= p sees j
    seen = later.any(0)                                            # [p, j]
    want = torch.where(seen, torch.arange(n)[None], n).amin(1)     # first key a query >= p sees
    got = first_needed(parts, torch.arange(n))
    print("positions where first_needed differs from the dense oracle:", int((got != want).sum()))
    assert torch.equal(got, want)


def test_cache_bound_and_eq4():
    assert cache_bound(poslsh.Partitions.fixed_blocks(3, 7)) == 6
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(8), 10, seed=1)
    b = cache_bound(parts)
    assert b == math.ceil(float(parts.widths.max())) - 1
    whp = cache_bound_whp(poslsh.alibi_sigmas(8), 10, delta=0.01)
    print(f"widest block - 1 = {b}, eq. (4) bound (delta 0.01 per head) = {whp:.0f}")
    assert b < whp < 1e4


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_window_decoding_equals_dense_oracle_at_every_position(dtype, tol):
    """A long sequence, a narrow and a wide head, GQA, chunks of 1..64 tokens: every step
    equals the full-sequence dense float64 oracle, and the window stays within the bound."""
    parts, n = narrow_and_wide(), 1500
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, n, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, n, 8, generator=g, dtype=torch.float64)
    want = poslsh.poslsh_attention_reference(q, k, v, parts, causal=True)
    win = KVWindow(parts, backend="torch")
    sizes, pos, outs, i = [], 0, [], 0
    chunks = [1, 1, 3, 64, 1, 17, 1, 1, 40, 2]
    while pos < n:
        c = min(chunks[i % len(chunks)], n - pos)
        sl = slice(pos, pos + c)
        outs.append(win.step(q[:, :, sl].to(dtype), k[:, :, sl].to(dtype), v[:, :, sl].to(dtype)))
        assert win.size <= win.bound and win.peak <= win.bound + max(chunks)
        sizes.append(win.size)
        pos, i = pos + c, i + 1
    err = float((torch.cat(outs, 2).double() - want).abs().max())
    print(f"{dtype}: max |window - dense oracle| over {n} positions = {err:.2e}; kept keys: max {max(sizes)}, "
          f"final {win.size}, bound {win.bound}, peak attended {win.peak}")
    assert err < tol
    assert win.start > 0 and max(sizes) < n // 2          # keys were really dropped


def test_dropping_one_more_key_is_loud():
    parts, n = narrow_and_wide(), 400
    q, k, v = (torch.randn(1, 2 if i == 0 else 1, n, 8, dtype=torch.float64) for i in range(3))
    p = n - 1
    c0 = int(first_needed(parts, torch.tensor([p]))[0])
    out = poslsh.poslsh_attention(q[:, :, p:], k[:, :, c0:], v[:, :, c0:], parts, causal=True, q_start=p,
                                  k_start=c0, backend="torch")
    want = poslsh.poslsh_attention_reference(q, k, v, parts, causal=True)[:, :, p:]
    assert float((out - want).abs().max()) < 1e-12
    with pytest.raises(ValueError, match="must not drop keys"):
        poslsh.poslsh_attention(q[:, :, p:], k[:, :, c0 + 1:], v[:, :, c0 + 1:], parts, causal=True, q_start=p,
                                k_start=c0 + 1, backend="torch")


def test_window_rejects_bad_input():
    win = KVWindow(narrow_and_wide())
    x = torch.randn(1, 2, 3, 8)
    win.step(x, x[:, :1], x[:, :1])
    with pytest.raises(ValueError, match="one KVWindow per stream"):
        win.step(x, x, x)
    with pytest.raises(ValueError, match="same nq"):
        win.step(x, x[:, :1, :2], x[:, :1, :2])
    with pytest.raises(TypeError, match="Partitions or a poslsh.AlibiWindow"):
        KVWindow("not partitions")
    with pytest.raises(ValueError, match="can see keys from 0"):
        KVWindow.from_prefill(narrow_and_wide(), x[:, :1], x[:, :1], start=1)     # a key the next query needs
    with pytest.raises(ValueError, match="needs cu_seqlens or document_ids"):
        document_rows(x, x)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        document_rows(x, x, cu_seqlens=torch.tensor([0, 2]))


# ------------------------------------------------------------------ ALiBi window
WINDOWS = [0, 9, 33, 70]         # per head; the cache keeps max = 70 keys


def alibi_window(windows=WINDOWS):
    return make_window(poslsh.alibi_slopes(len(windows)), torch.tensor(windows))


def test_first_needed_of_a_window_is_exactly_the_first_key_any_later_query_sees():
    win, n = alibi_window(), 300
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    heads = [((i - j).abs() <= w) & (j <= i) for w in WINDOWS]                 # [p, j] per head
    first = []
    for seen in heads + [torch.stack(heads).any(0)]:
        later = seen.flip(0).cummax(0).values.flip(0)                           # some query >= p sees j
        first.append(torch.where(later, j, n).amin(1))
    assert torch.equal(first_needed(win, torch.arange(n), per_head=True), torch.stack(first[:-1]))
    assert torch.equal(first_needed(win, torch.arange(n)), first[-1])
    assert cache_bound(win) == 70 and cache_bound(win, per_head=True) == WINDOWS


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_window_decoding_equals_dense_oracle_holding_exactly_w_keys(dtype, tol, per_head):
    """Four heads with windows 0, 9, 33, 70, GQA, chunks of 1..64 tokens: every step equals the
    dense float64 oracle. Per head, after every step KV head j holds exactly min(end, w_j + 1) rows
    (w_j = 9 and 70: the widest of its query heads); shared, the cache holds min(end, 70) keys for
    every head, of which head h can still see min(end, w_h)."""
    win, n = alibi_window(), 400
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    want = alibi_attention_reference(q, k, v, win.slopes, window=win.window, causal=True)
    cache = KVWindow(win, backend=WINDOW_AND_DOCUMENTS_BACKEND, per_head=per_head)
    pos, outs, i, chunks = 0, [], 0, [1, 1, 3, 64, 1, 17, 1, 1, 40, 2]
    while pos < n:
        c = min(chunks[i % len(chunks)], n - pos)
        sl = slice(pos, pos + c)
        outs.append(cache.step(q[:, :, sl].to(dtype), k[:, :, sl].to(dtype), v[:, :, sl].to(dtype)))
        pos, i = pos + c, i + 1
        if per_head:
            assert cache.kept_keys().tolist() == [min(pos, 10), min(pos, 71)] and cache.size == min(pos, 71)
            rows, es = min(pos, 10) + min(pos, 71), torch.empty(0, dtype=dtype).element_size()
            assert rows * 2 * 2 * 8 * es <= cache.nbytes() <= 1.15 * 2 * 2 * 8 * es * (10 + 71)   # B x (k, v) x d
        else:
            assert cache.size == min(pos, 70) == cache.k.shape[2] and cache.peak <= 70 + max(chunks)
        assert cache.needed_per_head == [min(pos, w) for w in WINDOWS]
    err = float((torch.cat(outs, 2).double() - want).abs().max())
    print(f"{dtype}: max |cached window - dense oracle| over {n} positions = {err:.2e}; kept {cache.size} keys "
          f"(bound {cache.bound}), per head {cache.needed_per_head}, peak attended {cache.peak}")
    assert err < tol


def test_a_window_keeps_no_key_too_many():
    """With one key fewer than first_needed the widest head's output changes (the dense oracle,
    which takes any keys, shows it) and every backend (the reference one too) refuses the call,
    naming the gap: the kept keys are exactly the ones a later query needs."""
    win, n = alibi_window(), 200
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, n, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 4, n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    p = n - 1
    want = alibi_attention_reference(q, k, v, win.slopes, window=win.window, causal=True)[:, :, p:]
    first = int(first_needed(win, [p])[0])
    errs = []
    out = poslsh.windowed_alibi_attention(q[:, :, p:], k[:, :, first:], v[:, :, first:], win.slopes, window=win.window,
                                          causal=True, q_start=p, k_start=first, backend=WINDOW_AND_DOCUMENTS_BACKEND)
    errs.append((out - want).abs().amax((0, 2, 3)))                             # per head
    short = alibi_attention_reference(q[:, :, p:], k[:, :, first + 1:], v[:, :, first + 1:], win.slopes,  # the oracle
                                   window=win.window, causal=True, q_start=p, k_start=first + 1)
    errs.append((short - want).abs().amax((0, 2, 3)))
    assert float(errs[0].max()) < 1e-12
    assert float(errs[1][3]) > 1e-3 and float(errs[1][:3].max()) < 1e-12
    for backend in (WINDOW_AND_DOCUMENTS_BACKEND, "reference"):       # every backend refuses, in the same words
        with pytest.raises(ValueError, match=f"can see keys in \\[{first}, {n}\\): pass keys from k_start <= {first}"):
            poslsh.windowed_alibi_attention(q[:, :, p:], k[:, :, first + 1:], v[:, :, first + 1:], win.slopes,
                                            window=win.window, causal=True, q_start=p, k_start=first + 1,
                                            backend=backend)


# ------------------------------------------------------------------ packed prefill
@pytest.mark.parametrize("kind", ["partitions", "window"])
def test_packed_prefill_then_per_document_decoding_equals_each_document_alone(kind):
    """Five documents (37, 1, 0, 82 and 60 tokens) prefilled as one packed row, then each
    continued by 25 tokens through its own KVWindow: the prefill rows and every continuation
    equal the document run alone (prefill + decoding) and the dense oracle on the document."""
    positional = (poslsh.sample_partitions(torch.tensor([2.0, 12.0], dtype=torch.float64), 4, seed=0)
                  if kind == "partitions" else alibi_window([5, 30]))
    steps = "torch" if kind == "partitions" else WINDOW_AND_DOCUMENTS_BACKEND
    lengths, T, chunks = [37, 1, 0, 82, 60], 25, [1, 3, 1, 20]
    cu = torch.tensor([0] + lengths).cumsum(0)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, int(cu[-1]), 8, generator=g, dtype=torch.float64) for h in (2, 1, 1))
    more = [[torch.randn(1, h, T, 8, generator=g, dtype=torch.float64) for h in (2, 1, 1)] for _ in lengths]
    packed = attend(q, k, v, positional, causal=True, cu_seqlens=cu, backend=WINDOW_AND_DOCUMENTS_BACKEND)
    caches = packed_windows(positional, k, v, cu_seqlens=cu, backend=steps)
    assert len(caches) == len(lengths)
    worst = 0.0
    for d, (m, cache) in enumerate(zip(lengths, caches)):
        a = int(cu[d])
        doc = [torch.cat([t[:, :, a:a + m], x], 2) for t, x in zip((q, k, v), more[d])]   # the document alone
        if kind == "partitions":
            want = poslsh.poslsh_attention_reference(*doc, positional, causal=True)
        else:
            want = alibi_attention_reference(*doc, positional.slopes, window=positional.window, causal=True)
        alone = KVWindow(positional, backend=steps)
        got_alone = [alone.step(*(t[:, :, :m] for t in doc))] if m else []
        got, pos = [], 0
        for c in chunks:
            chunk = [x[:, :, pos:pos + c] for x in more[d]]
            got.append(cache.step(*chunk))
            got_alone.append(alone.step(*chunk))
            pos += c
            assert (cache.start, cache.end, cache.size) == (alone.start, alone.end, alone.size)
            if kind == "window":            # per-head rings: w_j + 1 rows (the oldest is overwritten next)
                assert cache.size == min(cache.end, 31) and cache.kept_keys().tolist() == [min(cache.end, 31)]
            else:
                assert cache.size <= cache.bound
        errs = [float((packed[:, :, a:a + m] - want[:, :, :m]).abs().max()) if m else 0.0,
                float((torch.cat(got, 2) - want[:, :, m:]).abs().max()),
                float((torch.cat(got, 2) - torch.cat(got_alone, 2)[:, :, m:]).abs().max())]
        print(f"{kind} document {d} ({m} tokens + {T}): |packed prefill - oracle| {errs[0]:.1e}, |continuation - "
              f"oracle| {errs[1]:.1e}, |continuation - document alone| {errs[2]:.1e}; kept {cache.size} keys")
        worst = max(worst, *errs)
    assert worst < 1e-12
    assert max(c.start for c in caches) > 0           # keys were really dropped


def test_document_rows_follow_document_ids_row_by_row():
    ids = torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]])
    k = torch.arange(2 * 5, dtype=torch.float64).reshape(2, 1, 5, 1)
    rows = document_rows(k, -k, document_ids=ids)
    assert [r[0].flatten().tolist() for r in rows] == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    assert all(torch.equal(kd, -vd) for kd, vd in rows)
