"""Context-parallel attention on 2, 3 and 4 gloo processes (CPU) against the single-device
op and the dense float64 reference: forward and dq, dk, dv, causal and not, GQA, uneven
and one-token shards, narrow heads and heads whose halo is longer than a shard; positional
LSH and the ALiBi window (a halo of max_h w_h)."""
import math
from dataclasses import replace

import pytest
import torch

import poslsh
from poslsh.reference import alibi_attention_reference
from poslsh.window import make_window
from poslsh.distributed import ShardLayout, key_ranges, shard_range

from cp_harness import attention_worker, case_positional, case_tensors, error_worker, run_world

WINDOW_BACKEND = "torch"    # the window op's local kernel

MIXED = [1.5, 6.0, 40.0, 400.0]       # narrow to wider than a shard
WIDE = [60.0, 200.0, 700.0, 2000.0]   # blocks span several shards: multi-hop halos
NARROW = [0.5, 0.9, 1.3, 2.5]         # bins of width <= 1 (one-token blocks) included
MEDIUM = [2.0, 8.0, 16.0, 30.0]       # with seed 14: halos ending inside shards two or three ranks away
BASE = dict(B=2, Hq=4, Hkv=2, d=8, dv=6, sigmas=MIXED, s=4, seed=0, causal=True, block=None, window=None,
            backend="torch")


def case(name, lengths, multihop=None, **kw):
    """``multihop``: True/False asserts that some halo does/doesn't reach past a neighbour's shard."""
    return dict(BASE, name=name, lengths=lengths, multihop=multihop, **kw)


def window_case(name, lengths, window, **kw):
    return case(name, lengths, window=window, backend=WINDOW_BACKEND, **kw)


CASES = {
    2: [case("even-causal", [50, 47]),
        case("even-bidirectional", [50, 47], causal=False, seed=1),
        case("one-token-shard-mqa", [1, 96], sigmas=WIDE, Hkv=1, s=3, seed=2),
        window_case("window-causal", [50, 47], [0, 3, 20, 60], seed=20),
        window_case("window-bidirectional-uneven", [61, 36], [0, 3, 20, 60], causal=False, seed=21)],
    3: [window_case("window-causal-uneven", [30, 1, 66], [2, 5, 40, 7], seed=22, multihop=True),
        window_case("window-bidirectional-uneven", [30, 1, 66], [2, 5, 40, 7], causal=False, seed=23,
                    multihop=True),
        window_case("window-mqa-one-token-shards", [1, 95, 1], [1, 4, 9, 2], Hkv=1, seed=24, causal=False,
                    multihop=False),
        window_case("window-zero", [30, 40, 27], [0, 0, 0, 0], causal=False, seed=25, multihop=False),
        case("uneven-causal", [30, 40, 27], seed=3),
        case("wide-bidirectional", [30, 40, 27], sigmas=WIDE, causal=False, seed=4, multihop=True),
        case("wide-causal-1-token-middle", [33, 1, 63], sigmas=WIDE, seed=5, multihop=True),
        case("narrow-bidirectional", [40, 29, 28], sigmas=NARROW, Hkv=4, s=6, causal=False, seed=6,
             multihop=False)],
    4: [case("wide-causal", [1, 50, 33, 47], sigmas=WIDE, seed=7, multihop=True),
        case("mixed-bidirectional", [1, 50, 33, 47], causal=False, seed=8),
        case("fixed-blocks-aligned", [32, 32, 32, 32], block=16, causal=False, seed=9, multihop=False),
        case("partial-multihop-causal", [60, 7, 9, 121], sigmas=MEDIUM, seed=14, multihop=True),
        case("partial-multihop-bidirectional", [60, 7, 9, 121], sigmas=MEDIUM, seed=14, causal=False,
             multihop=True),
        case("alibi-s10", [64, 65, 64, 64], B=1, sigmas=poslsh.alibi_sigmas(4).tolist(), s=10, seed=10)],
}
MESH_CASES = [case("mesh-causal", [37, 60], seed=11), case("mesh-bidirectional", [37, 60], causal=False, seed=12)]

_RUNS = {}


def results(key):
    """Run a world once per module (all its cases in one set of processes)."""
    if key not in _RUNS:
        _RUNS[key] = (run_world(4, attention_worker, MESH_CASES, (2, 2)) if key == "mesh"
                      else run_world(key, attention_worker, CASES[key]))
    return _RUNS[key]


def single_device(c, backend):
    """out, dq, dk, dv of the whole sequence on one device: the op on ``backend``, or the
    float64 oracle (``backend="oracle"``)."""
    q, k, v, w = case_tensors(c)
    for t in (q, k, v):
        t.requires_grad_(True)
    pos = case_positional(c)
    if backend == "oracle" and c["window"] is not None:
        out = alibi_attention_reference(q, k, v, pos.slopes, window=pos.window, causal=c["causal"])
    elif backend == "oracle":
        out = poslsh.poslsh_attention_reference(q, k, v, pos, causal=c["causal"])
    elif c["window"] is not None:
        out = poslsh.windowed_alibi_attention(q, k, v, pos.slopes, window=pos.window, causal=c["causal"],
                                              backend=backend)
    else:
        out = poslsh.poslsh_attention(q, k, v, pos, causal=c["causal"], backend=backend)
    return [out.detach(), *torch.autograd.grad((out * w).sum(), (q, k, v))]


def check(c, ranks):
    got = [torch.cat([r[x] for r in ranks], 2) for x in ("out", "dq", "dk", "dv")]
    layout = ShardLayout(0, sum(c["lengths"]), tuple(ranks[0]["starts"]), tuple(c["lengths"]), tuple(ranks[0]["lo"]),
                         tuple(ranks[0]["hi"]), c["causal"])
    halos = [layout.halo(r) for r in range(len(ranks))]
    errors = {}
    for backend in (c["backend"], "oracle"):
        want = single_device(c, backend)
        errors[backend] = [float((a - b).abs().max()) for a, b in zip(got, want)]
    print(f"{c['name']}: shards {c['lengths']} causal={c['causal']} halos (left, right) {halos}; "
          f"max |error| of out, dq, dk, dv vs single-device {c['backend']} {errors[c['backend']]}, vs the float64 "
          f"oracle {errors['oracle']}")
    assert max(errors[c["backend"]] + errors["oracle"]) <= 1e-12
    if c["window"] is not None:     # the halo is max_h w_h, cut at the sequence's ends
        W, n = max(c["window"]), layout.seq_len
        for r in range(len(ranks)):
            a, b = layout.shard(r)
            assert layout.lo[r] == max(0, a - W) and layout.hi[r] == (b if c["causal"] else min(n, b + W))
    # Bytes: forward receives the halo's K|V rows, backward the gradients of the rows served to others.
    row = c["B"] * c["Hkv"] * (c["d"] + c["dv"]) * 8
    for r, res in enumerate(ranks):
        served = sum(y - x for _, x, y in replace(layout, rank=r).sends())
        assert res["received"] == res["sent"] == row * (sum(halos[r]) + served), (r, res["received"])
    multihop = any(layout.lo[r] < layout.starts[r - 1] for r in range(1, len(ranks))) or any(
        layout.hi[r] > layout.starts[r + 1] + layout.lengths[r + 1] for r in range(len(ranks) - 1))
    if c["sigmas"] is MEDIUM:   # the halo of rank 3 starts inside rank 0's shard, past ranks 2 and 1
        assert layout.lo[3] == 40 and (c["causal"] or layout.hi[0] == 103), (layout.lo, layout.hi)
    assert c["multihop"] in (None, multihop), f"{c['name']}: halos {halos} (a multi-hop halo expected: {c['multihop']})"
    if c["block"] is not None or c["window"] == [0] * c["Hq"]:
        assert all(r["received"] == 0 for r in ranks), "blocks aligned with the shards / window 0 need no halo"


@pytest.mark.parametrize("world,index", [(w, i) for w, cs in CASES.items() for i in range(len(cs))],
                         ids=[f"P{w}-{c['name']}" for w, cs in CASES.items() for c in cs])
def test_equals_single_device(world, index):
    check(CASES[world][index], [r[index] for r in results(world)])


@pytest.mark.parametrize("index", range(len(MESH_CASES)), ids=[c["name"] for c in MESH_CASES])
def test_context_group_of_a_2d_mesh(index):
    """4 ranks as a (data 2 x context 2) device mesh: each replica's context group (global
    ranks {0, 1} and {2, 3}) attends over its own sequence."""
    runs = [r[index] for r in results("mesh")]
    for replica in (0, 1):
        ranks = sorted((r for r in runs if r["replica"] == replica), key=lambda r: r["crank"])
        c = dict(MESH_CASES[index], seed=MESH_CASES[index]["seed"] + replica)
        check(c, ranks)


def test_clear_errors_on_every_rank():
    """Every bad call raises the same one-line ValueError on every rank: disagreements on
    anything that changes the result (scale, window, positional kind, backend, ...) and bad
    input on some ranks, whatever exception it raised there (a rank never waits for a peer
    that raised before the collective)."""
    msgs = run_world(3, error_worker)
    for name, m in msgs[0].items():
        print(f"{name}: {m}")
    assert all(m == msgs[0] for m in msgs), "every rank must raise the same error"
    m = msgs[0]
    assert "contiguous and ordered by rank" in m["gap"] and "rank 1's shard ends at 40" in m["gap"]
    assert "contiguous and ordered by rank" in m["order"] and "the first shard must start at 0" in m["order"]
    assert "partitions differ across ranks" in m["partitions"] and "[[0, 2], [1]]" in m["partitions"]
    assert "seq_len" in m["seq_len"] and "60" in m["seq_len"]
    assert "given on ranks [0] only" in m["some_starts"]
    assert "disagree on causal" in m["causal"]
    assert f"disagree on scale: [{1 / math.sqrt(8)}, 0.5, {1 / math.sqrt(8)}]" in m["scale"]
    assert m["scale_resolved"] is None                        # None means 1 / sqrt(d): the same scale
    assert "ALiBi windows (slopes, windows) differ" in m["window"] and "[[0, 1], [2]]" in m["window"]
    assert "positional object: ['AlibiWindow', 'Partitions', 'Partitions']" in m["kind"]
    assert "differentiated" in m["grad"] and "[True, False, False]" in m["grad"]
    assert "different backends" in m["backend"] and "[[0, 1], [2]]" in m["backend"]
    assert m["none_positional"].startswith("context-parallel attention: bad input on rank 1: TypeError: "
                                           "positional must be a poslsh.Partitions or a poslsh.AlibiWindow")
    assert "bad input on rank 1: RuntimeError: this scale cannot be read" in m["unexpected_error"]
    assert "bad input on rank 1: ValueError: backend: unknown backend 'no-such-backend'" in m["unknown_backend"]
    assert ("bad input on ranks 0, 2: rank 0: ValueError: head_dim of q (8) and k (4) differ; rank 2: TypeError: "
            "positional must be") in m["two_bad_ranks"]
    assert "bad input on rank 1: ValueError: head_dim of q (8) and k (4) differ" in m["one_bad_rank"]
    assert "bad input on ranks 0, 1, 2: ValueError: head_dim of q (8) and k (4) differ (every" in m["all_bad_alike"]
    assert all("\n" not in x for x in m.values() if isinstance(x, str)), "one-line errors"
    assert m["ok_after"] is True


# ------------------------------------------------------------- no processes
@pytest.mark.parametrize("causal", [True, False])
def test_key_ranges_of_a_window_are_the_union_of_the_shards_windows(causal):
    win = make_window(poslsh.alibi_slopes(4), torch.tensor([0, 7, 130, 3]))
    n, starts, lengths = 500, [0, 1, 120, 121, 300], [1, 119, 1, 179, 200]
    lo, hi = key_ranges(win, n, starts, lengths, causal)
    seen = (torch.arange(n)[:, None] - torch.arange(n)[None]).abs() <= 130     # [query, key], widest head
    if causal:
        seen &= torch.arange(n)[None] <= torch.arange(n)[:, None]
    for a, m, l_, h_ in zip(starts, lengths, lo, hi):
        keys = torch.nonzero(seen[a:a + m].any(0))[:, 0]
        assert (l_, h_) == (int(keys.min()), int(keys.max()) + 1)


@pytest.mark.parametrize("causal", [True, False])
def test_key_ranges_are_the_union_of_the_shards_blocks(causal):
    """The two-position shortcut equals the brute-force union over every query of the shard."""
    parts = poslsh.sample_partitions(torch.tensor(MIXED + NARROW + WIDE), 5, seed=3)
    n, starts, lengths = 500, [0, 1, 120, 121, 300], [1, 119, 1, 179, 200]
    lo, hi = key_ranges(parts, n, starts, lengths, causal)
    start, end = parts.block_bounds(n, torch.arange(n))          # [H, s, n]
    for a, m, l_, h_ in zip(starts, lengths, lo, hi):
        pos = torch.arange(a, a + m)
        want_hi = a + m if causal else int(end[:, :, pos].max())
        assert (l_, h_) == (int(start[:, :, pos].min()), want_hi)


def test_shard_range_and_layout_plan():
    assert [shard_range(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(ValueError, match="non-empty shard"):
        shard_range(3, 0, 4)
    lay = ShardLayout(1, 100, (0, 10, 40, 70), (10, 30, 30, 30), (0, 0, 5, 60), (10, 40, 75, 100), False)
    assert lay.recvs() == [(0, 0, 10)] and lay.halo() == (10, 0)
    assert lay.sends() == [(2, 10, 40)]          # rank 3 needs [60, 100): nothing of [10, 40)
