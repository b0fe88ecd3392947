"""The per-head window store (poslsh.decoding.HeadWindows) against the dense float64 oracle: every KV head
keeps its own window, decoding steps and chunks equal exact windowed ALiBi, left padding and row selection
keep working, sink keys, the certificate's bound against exact ALiBi over every past key, its policies and
the refusals."""
import math
import warnings

import pytest
import torch

import poslsh
from poslsh.decoding import (Certificate, CertificateWarning, HeadWindows, KVWindow, certified_window,
                             head_buckets)
from poslsh.reference import alibi_attention_reference, dense_attention
from poslsh.window import make_window
from poslsh.window.kind import NO_WINDOW


def qkv(B, Hq, Hkv, n, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, n, d, generator=g, dtype=dtype), torch.randn(B, Hkv, n, d, generator=g, dtype=dtype),
            torch.randn(B, Hkv, n, d, generator=g, dtype=dtype))


def run(store, q, k, v, chunks, valid=None):
    outs, pos, i = [], 0, 0
    while pos < q.shape[2]:
        c = min(chunks[i % len(chunks)], q.shape[2] - pos)
        sl = slice(pos, pos + c)
        outs.append(store.attend(q[:, :, sl], k[:, :, sl], v[:, :, sl],
                                 valid=None if valid is None else valid[:, sl]))
        pos, i = pos + c, i + 1
    return torch.cat(outs, 2)


@pytest.mark.parametrize("Hkv", [6, 3, 1])
def test_steps_and_chunks_equal_the_dense_oracle_holding_each_heads_window(Hkv):
    """Six heads with windows 0, 3, 17, 40, 9 and exact ALiBi (NO_WINDOW), GQA 1/2/6, batch 2, tokens one by
    one and in chunks of 1..40: every output equals the dense float64 oracle, and KV head j holds exactly
    min(tokens, w_j + 1) rows, w_j the widest window of its query heads."""
    wins = [0, 3, 17, 40, 9, NO_WINDOW]
    win = make_window(poslsh.alibi_slopes(6), torch.tensor(wins))
    q, k, v = qkv(2, 6, Hkv, 230, seed=Hkv)
    want = alibi_attention_reference(q, k, v, win.slopes, window=win.window, causal=True)
    r = 6 // Hkv
    kv_w = [min(max(wins[j * r:(j + 1) * r]), 2 ** 61) for j in range(Hkv)]
    for chunks in ([1], [1, 1, 3, 40, 1, 17, 2]):
        store = HeadWindows(win)
        got, pos, i = [], 0, 0
        while pos < 230:
            c = min(chunks[i % len(chunks)], 230 - pos)
            got.append(store.attend(*(t[:, :, pos:pos + c] for t in (q, k, v))))
            pos, i = pos + c, i + 1
            assert store.kept_keys().tolist() == [min(pos, w + 1) for w in kv_w]
        err = float((torch.cat(got, 2) - want).abs().max())
        print(f"Hkv {Hkv}, chunks {chunks}: max |per-head cache - oracle| {err:.1e}, rows {store.kept_keys().tolist()}")
        assert err < 1e-12


def test_rows_grow_then_stay_at_their_window_and_bytes_are_sum_of_windows():
    wins = [4, 9, 17, 40]
    store = HeadWindows(make_window(poslsh.alibi_slopes(4), torch.tensor(wins)))
    q, k, v = qkv(1, 4, 4, 120, d=16)
    for t in range(120):
        store.attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
        rows = sum(min(t + 1, w + 1) for w in wins)
        assert rows * 2 * 16 * 8 <= store.nbytes() <= 1.15 * rows * 2 * 16 * 8 + 64 * 4 * 2 * 16 * 8
    assert store.nbytes() == sum(w + 1 for w in wins) * (16 + 16) * 8     # exactly sum_h (w_h + 1) rows


def test_left_padded_rows_equal_each_row_alone_and_rows_can_be_reordered():
    """Rows with 0, 7 and 30 padding tokens (prefill chunks, then single steps): every real output equals the
    row run alone, padding outputs are zero; selecting / repeating rows (beam search) continues each row."""
    win = make_window(poslsh.alibi_slopes(4), torch.tensor([2, 5, 11, 23]))
    q, k, v = qkv(3, 4, 2, 80, seed=3)
    pads = [0, 7, 30]
    valid = torch.arange(80)[None] >= torch.tensor(pads)[:, None]
    store = HeadWindows(win)
    got = run(store, q, k, v, [13, 1, 20, 1, 1, 5], valid)
    for b, p in enumerate(pads):
        alone = HeadWindows(win)
        want = run(alone, q[b:b + 1, :, p:], k[b:b + 1, :, p:], v[b:b + 1, :, p:], [1])
        err = float((got[b:b + 1, :, p:] - want).abs().max())
        assert err < 1e-12 and float(got[b, :, :p].abs().sum()) == 0
    more = qkv(3, 4, 2, 6, seed=9)
    store.select_rows(torch.tensor([2, 2, 0]))
    sel = run(store, *(t[[2, 2, 0]] for t in more), [1])
    full = HeadWindows(win)
    run(full, q, k, v, [80], valid)
    ref = run(full, *more, [1])
    assert float((sel - ref[[2, 2, 0]]).abs().max()) < 1e-12


def test_sink_keys_are_kept_exactly():
    """sinks=3: each query also sees its row's first 3 positions with their ALiBi bias (the dense oracle with
    that mask), the window part unchanged; storage grows by the sinks only."""
    wins = torch.tensor([2, 6, 9, 30])
    win = make_window(poslsh.alibi_slopes(4), wins)
    q, k, v = qkv(2, 4, 2, 150, seed=5)
    store = HeadWindows(win, sinks=3)
    got = run(store, q, k, v, [1, 1, 40, 1, 7])
    i, j = torch.arange(150)[:, None], torch.arange(150)[None]
    seen = (j <= i) & (((i - j)[None] <= wins[:, None, None]) | (j < 3)[None])
    bias = (-win.slopes[:, None, None] * (i - j).abs()).masked_fill(~seen, -math.inf)
    want = dense_attention(q, k, v, bias[None])
    err = float((got - want).abs().max())
    print(f"sinks: max |cache - oracle| {err:.1e}")
    assert err < 1e-12
    assert store.nbytes() == ((3 + 7) + (3 + 31)) * 2 * 2 * 8 * 8      # (sinks + w_j + 1) x B x (k, v) x d x 8


def exact_alibi_row(q, k, v, slopes, p, scale):
    """Exact ALiBi (no window) of the query at p against keys [0, p], float64: [B, Hq, dv]."""
    r = q.shape[1] // k.shape[1]
    kk, vv = k[:, :, :p + 1].repeat_interleave(r, 1), v[:, :, :p + 1].repeat_interleave(r, 1)
    s = torch.einsum("bhd,bhjd->bhj", q[:, :, p], kk) * scale - slopes[None, :, None] * (p - torch.arange(p + 1))
    return torch.einsum("bhj,bhjd->bhd", torch.softmax(s, -1), vv)


def test_certificate_bounds_the_error_against_exact_alibi_at_every_step():
    """Windows from smallest_window at tol 1e-3 and Cauchy-Schwarz's logit range, 1200 steps with larger keys
    later on: at sampled steps the bound is >= the true dropped mass and |cached - exact ALiBi over every past
    key| <= the error bound; no step exceeds tol (policy "raise")."""
    slopes, scale = poslsh.alibi_slopes(4), 8 ** -0.5
    q, k, v = qkv(2, 4, 2, 1200, seed=7)
    k[:, :, 600:] *= 1.5
    R = 2 * scale * float(q.norm(dim=-1).max()) * float(k.norm(dim=-1).max())
    win = certified_window(1e-3, R, slopes=slopes)
    store = HeadWindows(win, certificate=Certificate(1e-3, "raise"))
    worst, checked = 0.0, 0
    for p in range(1200):
        out = store.attend(q[:, :, p:p + 1], k[:, :, p:p + 1], v[:, :, p:p + 1])[:, :, 0]
        if p % 37 == 0 or p > 1190:
            exact = exact_alibi_row(q, k, v, slopes, p, scale)
            bound = store.last_error_bound[:, :, 0]
            assert bool(((out - exact).abs() <= bound + 1e-12).all())
            kk = k[:, :, :p + 1].repeat_interleave(2, 1)
            s = torch.einsum("bhd,bhjd->bhj", q[:, :, p], kk) * scale - slopes[None, :, None] * (p - torch.arange(p + 1))
            dropped = (p - torch.arange(p + 1))[None, None] > win.window[None, :, None]
            mass = (torch.softmax(s, -1) * dropped).sum(-1)
            assert bool((mass <= store.last_bound[:, :, 0] + 1e-15).all())
            worst, checked = max(worst, float(mass.max())), checked + 1
    print(f"R = {R:.1f}, windows {win.window.tolist()}: {checked} steps checked, worst true dropped mass {worst:.1e}, "
          f"worst bound {store.stats['worst']:.1e}")
    assert store.stats["steps"] == 1200 and 0 < worst <= store.stats["worst"] <= 1e-3
    assert store.stats["exceeded"] == [0, 0, 0, 0]


def too_small(policy, **kw):
    win = make_window(poslsh.alibi_slopes(4), torch.tensor([1, 1, 1, 1]))
    return HeadWindows(win, certificate=Certificate(1e-6, policy, **kw), name="layer 0")


def test_a_too_small_window_trips_the_certificate_per_policy():
    q, k, v = qkv(1, 4, 4, 40, seed=1)
    store = too_small("raise")
    with pytest.raises(ValueError, match=r"layer 0: certificate: head \d dropped up to .* at position 2, above tol=1e-06") as e:
        run(store, q, k, v, [1])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="build a new cache"):
        store.attend(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    store = too_small("warn")
    with pytest.warns(CertificateWarning, match="above tol=1e-06"):
        run(store, q, k, v, [1])
    assert sum(store.stats["exceeded"]) > 0 and store.win == [1, 1, 1, 1]
    store = too_small("widen", cap=20)
    with pytest.warns(CertificateWarning):
        out = run(store, q, k, v, [1])
    print("widened windows", store.win, store.stats)
    assert min(store.win) > 1 and max(store.win) <= 20 and min(store.stats["widened"]) > 0
    assert store.kept_keys().tolist() == [min(40, w + 1) for w in store.win]
    assert torch.isfinite(out).all()


def test_refusals_are_one_line():
    win = make_window(poslsh.alibi_slopes(2), torch.tensor([5, 500]))
    with pytest.raises(ValueError, match="head 1 needs a window of 500 keys, more than cap=100") as e:
        HeadWindows(win, certificate=Certificate(1e-3, "raise", cap=100))
    assert "\n" not in str(e.value)
    with pytest.warns(CertificateWarning, match="cut to it"):
        assert HeadWindows(win, certificate=Certificate(1e-3, "warn", cap=100)).win == [5, 100]
    for bad, word in ((dict(tol=0), "tol"), (dict(tol=1e-3, policy="loud"), "policy"), (dict(tol=1e-3, cap=-1), "cap")):
        with pytest.raises(ValueError, match=word):
            Certificate(**bad)
    with pytest.raises(TypeError, match="AlibiWindow"):
        HeadWindows(poslsh.Partitions.fixed_blocks(2, 4))
    with pytest.raises(ValueError, match="only a per-head window cache"):
        KVWindow(poslsh.Partitions.fixed_blocks(2, 4), sinks=2)
    store = HeadWindows(win)
    x = torch.randn(1, 2, 1, 4)
    store.attend(x, x, x)
    with pytest.raises(ValueError, match="one cache per batch and layer"):
        store.attend(x, x.double(), x.double())
    with pytest.raises(ValueError, match="the certificate and the sinks need every key"):
        HeadWindows(win, sinks=1).fill(x, x, start=3)


def test_head_buckets_minimise_the_cost():
    import itertools
    from poslsh.decoding.heads import OP_COST
    rows, per = [50, 80, 100, 3000, 9000], [136] * 5

    def cost(buckets):
        return sum(OP_COST + sum(rows[a:b]) * sum(per[a:b]) for a, b in buckets)
    best = head_buckets(rows, per)
    every = []
    for cuts in itertools.product([0, 1], repeat=4):
        edges = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [5]
        every.append(cost(list(zip(edges[:-1], edges[1:]))))
    assert math.isclose(cost(best), min(every)) and best[0] == (0, 3) and best[-1] == (4, 5)


def test_row_groups_are_one_call_per_offset_holding_exactly_each_rows_real_tokens():
    """poslsh.decoding.rows.row_groups against every (row, query, key) by hand: a row's span holds exactly its
    queries and keys inside its real run, at positions counted from the run's start; rows share a group iff
    they share the span; rows with no real query are in none; an unpadded batch is one group."""
    from poslsh.decoding.rows import row_groups
    g = torch.Generator().manual_seed(5)
    for q_first, nq, k_first in [(0, 9, 0), (7, 1, 2), (12, 5, 0), (3, 4, 3)]:
        total = q_first + nq
        nk = total - k_first
        runs = [None, (0, total), (0, 0)]
        for _ in range(6):
            s = int(torch.randint(0, total + 1, (1,), generator=g))
            runs.append((s, int(torch.randint(s, total + 1, (1,), generator=g))))
        groups = row_groups(runs, q_first, nq, k_first, nk)
        spans = {b: span for span, rows in groups.items() for b in rows}
        assert sum(len(rows) for rows in groups.values()) == len(spans)            # each row in one group at most
        for b, run in enumerate(runs):
            real = set() if run is None else set(range(*run))
            queries = [i for i in range(nq) if q_first + i in real]
            if not queries:
                assert b not in spans, (b, run)
                continue
            s = spans[b]
            assert list(range(s.i0, s.i1)) == queries
            assert list(range(s.j0, s.j1)) == [j for j in range(nk) if k_first + j in real]
            assert (s.q_start, s.k_start) == (q_first + s.i0 - run[0], k_first + s.j0 - run[0])
        assert list(row_groups([(0, total)] * 3, q_first, nq, k_first, nk).values()) == [[0, 1, 2]]


def test_a_window_kvwindow_has_no_one_tensor():
    """KVWindow(window).k / .v: per-head storage has no one tensor (refused in one line naming what to use);
    the store gives the kept keys of positions [start, end) in order, zero where a KV head holds fewer."""
    win = make_window(poslsh.alibi_slopes(2), torch.tensor([3, 10]))
    q, k, v = qkv(1, 2, 2, 30)
    cache = KVWindow(win)
    for t in range(30):
        cache.step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
    for name in ("k", "v"):
        with pytest.raises(AttributeError, match=rf"KVWindow.{name}: .*stores each KV head's own window.*per_head=False"):
            getattr(cache, name)
    kk, vv = cache.store.ordered(cache.size)
    assert kk.shape == (1, 2, 11, 8) and cache.start == 19
    assert torch.equal(kk[:, 1], k[:, 1, 19:]) and torch.equal(kk[:, 0, -4:], k[:, 0, 26:])
    assert float(kk[:, 0, :-4].abs().sum()) == 0 and torch.equal(vv[:, 1], v[:, 1, 19:])


def test_a_chunk_after_widening_runs_token_by_token():
    """After "widen" grew a ring that has not refilled, a chunk of tokens equals feeding them one by one (the
    window op needs contiguous keys; the step reads the ring in place)."""
    q, k, v = qkv(1, 4, 4, 60, seed=2)
    a, b = too_small("widen", cap=30), too_small("widen", cap=30)
    with pytest.warns(CertificateWarning):
        run(a, q[:, :, :20], k[:, :, :20], v[:, :, :20], [1])
        run(b, q[:, :, :20], k[:, :, :20], v[:, :, :20], [1])
        assert a.win == b.win and not a._complete(a.total)
        chunk = a.attend(q[:, :, 20:27], k[:, :, 20:27], v[:, :, 20:27])
        ones = run(b, q[:, :, 20:27], k[:, :, 20:27], v[:, :, 20:27], [1])
    assert torch.equal(chunk, ones) and a.win == b.win and a.total == b.total == 27


def test_the_bound_holds_while_a_widened_ring_refills():
    """"widen" grows a ring whose older keys are gone: until it refills, those keys are dropped too, and every
    step's bound still covers |cached - exact ALiBi over every past key| (the window the held keys reach)."""
    slopes, scale = poslsh.alibi_slopes(4), 8 ** -0.5
    q, k, v = qkv(1, 4, 2, 120, seed=3)
    store = HeadWindows(make_window(slopes, torch.tensor([2, 2, 3, 3])), scale=scale,
                        certificate=Certificate(2e-2, "widen", widen_at=0.5), sinks=2)
    short = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CertificateWarning)
        for p in range(120):
            eff = store.effective_windows(p, 1)[:, 0] if store.K is not None else None
            short += int(eff is not None and bool((eff < torch.tensor(store.win)).any()))
            out = store.attend(q[:, :, p:p + 1], k[:, :, p:p + 1], v[:, :, p:p + 1])[:, :, 0]
            exact = exact_alibi_row(q, k, v, slopes, p, scale)
            assert bool(((out - exact).abs() <= store.last_error_bound[:, :, 0] + 1e-12).all()), p
    print(f"widened {store.stats['widened']} to {store.win}; {short} steps with a ring still refilling")
    assert short > 0 and min(store.stats["widened"]) > 0
