"""transformers' BLOOM as a run's model (``--model.kind bloom``, preset cpu-bloom): it trains with its own
eager ALiBi, evaluates at contexts past training with every target after ``(k-1) L`` tokens, skips (and
says) the eager lengths whose n x n scores pass the limit, and evaluates its trained weights through
``patch_alibi`` as exact ALiBi, windows and positional LSH (those tests skip where ``patch_alibi`` is absent).
Tiny configs on the offline synthetic corpus."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from poslsh_paper.experiments.command import ConfigError  # noqa: E402
from poslsh_paper.experiments.lm import bloom, bloom_table  # noqa: E402
from poslsh_paper.experiments.lm.config import check, get_preset, parse_method, run_dir  # noqa: E402
from poslsh_paper.experiments.lm.evaluation import evaluate, full_context_windows, scored_tokens  # noqa: E402
from poslsh_paper.experiments.lm.loop import train  # noqa: E402
from poslsh_paper.experiments.lm.model import Dist, build_model  # noqa: E402

TINY_DATA = dict(corpora=("synthetic",), tokenizer="bpe:300", synthetic_docs=150)
TINY_MODEL = dict(kind="bloom", hidden_size=32, num_layers=2, num_heads=4)


def tiny(tmp_path, method="original", **extra):
    base = get_preset("smoke")
    kw = dict(seq_len=32, batch_size=4, micro_batch_size=4, steps=4, eval_tokens=128, eval_batch_tokens=256,
              ckpt_interval=2, lr=3e-3, threads=1, eval_multipliers=(1, 4), eval_full_context=True)
    return replace(base, data=replace(base.data, **TINY_DATA), model=replace(base.model, **TINY_MODEL),
                   runs_dir=str(tmp_path / "runs"), cache_dir=str(tmp_path / "cache"), method=method,
                   **{**kw, **extra})


def has_patch_alibi() -> bool:
    from poslsh.integrations import hf
    return hasattr(hf, "patch_alibi")


needs_patch = pytest.mark.skipif(not has_patch_alibi(), reason="poslsh.integrations.hf.patch_alibi is not here")


def test_methods_and_refusals(tmp_path):
    assert parse_method("alibi-tol1e-3").window_tol == pytest.approx(1e-3)
    assert parse_method("alibi-tol1e-3").scheme == "alibi-window"
    with pytest.raises(ConfigError, match="model.kind bloom"):            # a certified window needs BLOOM
        check(replace(tiny(tmp_path, "alibi-tol1e-3"), model=get_preset("smoke").model), data=False)
    for method in ("fixed_blocks", "poslsh-g5"):
        with pytest.raises(ConfigError, match="not a way to run BLOOM"):
            check(tiny(tmp_path, method), data=False)
    with pytest.raises(ConfigError, match="unpacked"):
        check(tiny(tmp_path, pack=True), data=False)
    p = get_preset("cpu-bloom")
    assert (p.model.kind, p.method, p.seq_len, p.eval_multipliers) == ("bloom", "original", 256, (1, 4, 16, 64))
    check(p, data=False)


@pytest.mark.parametrize("heads", [4, 6, 12])
def test_slopes_are_blooms(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    got = bloom.bloom_slopes(heads)
    alibi = build_alibi_tensor(torch.ones(1, 5), heads, torch.float32)[:, 0]       # slope x position 0..4
    torch.testing.assert_close(alibi, (got[:, None] * torch.arange(5.0)).float())
    assert torch.all(got[:-1] != got[1:])


def test_full_context_windows_share_targets(tmp_path):
    cfg = tiny(tmp_path, eval_multipliers=(1, 4, 16))
    T = scored_tokens(10_000, cfg)
    assert T == 128
    ends = {k: [b + k * 32 for b in full_context_windows(T, k, cfg)] for k in (1, 4, 16)}
    assert ends[1] == ends[4] == ends[16]                        # the same targets at every length
    assert min(full_context_windows(T, 1, cfg)) == 15 * 32       # after the longest context's first window
    with pytest.raises(ValueError, match="fewer than one"):
        scored_tokens(16 * 32, cfg)


def test_eager_limit():
    cfg = get_preset("cpu-bloom")
    assert bloom.eager_skip(cfg, 1, 4096) is None
    said = bloom.eager_skip(cfg, 1, 16384)
    assert said and "24 GiB" in said and "16384" in said
    assert bloom.eager_skip(replace(cfg, method="alibi"), 1, 16384) is None      # the patched model has no n x n


def test_trains_and_evaluates_with_eager_skip(tmp_path, monkeypatch):
    cfg = tiny(tmp_path)
    # the 4x length (128 tokens, batch 2) needs 2 x 4 x 128^2 x 4 B x 3 = 1.5 MiB: over a 1 MiB limit
    monkeypatch.setattr(bloom, "EAGER_LIMIT_GIB", 1 / 1024)
    res = train(cfg, progress=False)
    assert res["final_train_loss"] < np.log(300) + 1
    ev = res["eval"]
    assert ev["1x"]["tokens"] == 128 and np.isfinite(ev["1x"]["ppl"])
    assert "skipped" in ev["4x"] and "not run" in ev["4x"]["skipped"]
    from transformers import BloomForCausalLM
    assert type(build_model(cfg, 300)) is BloomForCausalLM


def test_full_context_scores_each_target_once(tmp_path):
    """Each window scores its last L targets: equal to one forward per window, scored by hand."""
    cfg = tiny(tmp_path, eval_tokens=64, eval_multipliers=(1, 2))
    torch.manual_seed(0)
    model = build_model(cfg, 300).eval()
    tokens = np.random.default_rng(0).integers(0, 300, 400)
    got = evaluate(model, tokens, cfg, Dist("cpu"))
    for k in (1, 2):
        nll = []
        for b in full_context_windows(64, k, cfg):
            x = torch.from_numpy(tokens[b: b + 32 * k].astype(np.int64))[None]
            with torch.no_grad():
                logits = model(input_ids=x).logits[0, -32:]
            y = torch.from_numpy(tokens[b + 32 * k - 31: b + 32 * k + 1].astype(np.int64))
            nll.append(torch.nn.functional.cross_entropy(logits, y, reduction="none"))
        assert got[f"{k}x"]["tokens"] == 64
        assert got[f"{k}x"]["nll"] == pytest.approx(float(torch.cat(nll).mean()), rel=1e-5)


@needs_patch
def test_patched_methods(tmp_path):
    """Exact patch_alibi gives the eager model's logits; the windows are the ones named."""
    from poslsh.integrations import hf
    from poslsh.cost import cost_matched_window

    torch.manual_seed(0)
    eager = build_model(tiny(tmp_path), 300).eval()
    x = torch.randint(0, 300, (2, 70))
    want = eager(input_ids=x).logits
    for method in ("alibi", "alibi-w4", "alibi-wcost10", "alibi-tol1e-3", "poslsh-s10"):
        model = build_model(tiny(tmp_path, method), 300).eval()
        model.load_state_dict(eager.state_dict())
        got = model(input_ids=x).logits
        st = hf.alibi_stats(model)
        assert len(st) == 2 and torch.isfinite(got).all()
        if method == "alibi":
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        if method == "alibi-wcost10":
            assert st[0]["window"] == cost_matched_window(1 / bloom.bloom_slopes(4), num_samples=10).tolist()
        if method == "poslsh-s10":
            assert st[0]["num_samples"] == 10


@needs_patch
def test_table_end_to_end(tmp_path):
    cfg = tiny(tmp_path, steps=2, seeds=(0,), methods=("original", "alibi", "alibi-wcost10"))
    out = tmp_path / "out"
    recs = bloom_table.run_bloom_table(cfg, cfg.methods, cfg.seeds, out, progress=False)
    assert {r["method"] for r in recs} == {"original", "alibi", "alibi-wcost10"}
    d = out / "smoke"
    table = json.loads((d / "table.json").read_text())
    rows = {(r["method"], r["length"]): r for r in table["rows"]}
    for k in ("1x", "4x"):     # the patched exact model is the eager model at every length eager ran
        assert rows["alibi", k]["ppl_mean"] == pytest.approx(rows["original", k]["ppl_mean"], rel=1e-4)
    assert (d / "ppl_vs_context.png").stat().st_size > 1000
    assert (d / "runs" / "seed0" / "alibi-wcost10.json").is_file()
    assert "Findings, as measured" in (d / "table.md").read_text()
    assert (run_dir(replace(cfg, method="original")) / "eval-test-as-alibi.json").is_file()


@needs_patch
def test_table_evaluates_again_under_other_settings(tmp_path):
    """A record made with other evaluation settings is not this table's: the trained model is evaluated again."""
    cfg = tiny(tmp_path, steps=2, seeds=(0,), methods=("original", "alibi"))
    bloom_table.run_bloom_table(cfg, cfg.methods, cfg.seeds, tmp_path / "out", progress=False)
    assert not bloom_table.eval_path(cfg, "original", 0).exists()          # the run's own result.json stood in
    other = replace(cfg, eval_tokens=64)
    recs = bloom_table.run_bloom_table(other, other.methods, other.seeds, tmp_path / "out", progress=False)
    assert {r["eval"]["1x"]["tokens"] for r in recs} == {64}
    assert json.loads(bloom_table.eval_path(cfg, "original", 0).read_text())["eval_settings"]["eval_tokens"] == 64
