"""``poslsh eval --streaming``: one long document through the bounded cache equals one
full-context forward with the same fixed partitions, and runs from the CLI."""
import json
import math
import sys
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from poslsh_paper.experiments.command import ConfigError  # noqa: E402
from poslsh_paper.experiments.lm.commands import eval_main  # noqa: E402
from poslsh_paper.experiments.lm.config import EvalCommand, TrainConfig, run_dir  # noqa: E402
from poslsh_paper.experiments.lm.evaluation import position_bins, streaming_scores  # noqa: E402
from poslsh_paper.experiments.lm.loop import train  # noqa: E402
from poslsh.integrations import hf  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_train import tiny_cfg  # noqa: E402


@pytest.mark.parametrize("scheme", ["poslsh", "fixed_blocks"])
def test_streaming_equals_one_full_context_forward(scheme):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=4096, attention_dropout=0.0)
    model = hf.model_from_config(cfg, scheme, num_samples=3, block_size=24).to(torch.float64).eval()
    tokens = np.random.default_rng(0).integers(0, 61, 701)
    nll, hit, cache = streaming_scores(model, tokens, 64, torch.device("cpu"))
    with torch.no_grad():
        x = torch.from_numpy(tokens[:-1])[None]
        logits = model(x).logits[0]
    y = torch.from_numpy(tokens[1:])
    full = F.cross_entropy(logits, y, reduction="none").numpy()
    err = float(np.abs(nll - full).max())
    print(f"{scheme}: max |streaming - full-context| per-token NLL {err:.1e} over {len(nll)} tokens; "
          f"ppl {math.exp(nll.mean()):.4f} vs {math.exp(full.mean()):.4f}; cache {cache.stats()}")
    assert err < 1e-10 and np.array_equal(hit, (logits.argmax(-1) == y).numpy())
    assert all(s["kept"] <= s["bound"] for s in cache.stats())


def test_position_bins():
    assert position_bins(1000, 64) == [0, 64, 128, 256, 512, 1000]
    assert position_bins(50, 64) == [0, 50]


def test_eval_streaming_cli(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path, method="poslsh-s3", steps=2, ckpt_interval=2)
    train(cfg, progress=False, evaluate=False)
    base = {f.name: getattr(cfg, f.name) for f in fields(TrainConfig)}
    cmd = EvalCommand(**{**base, "eval_tokens": 600, "eval_batch_tokens": 128}, streaming=True, progress=False)
    assert eval_main(cmd) == 0
    out = capsys.readouterr().out
    print(out)
    res = json.loads((run_dir(cfg) / "eval-test-streaming.json").read_text())["streaming"]
    assert res["tokens"] == 600 and res["chunk"] == 128 and "streaming 600 tokens" in out
    assert [b["from"] for b in res["by_position"]] == [0, 32, 64, 128, 256, 512]
    assert sum(b["tokens"] for b in res["by_position"]) == 600
    assert math.isclose(math.log(res["ppl"]), sum(b["tokens"] * math.log(b["ppl"]) for b in res["by_position"]) / 600)
    assert res["cache"]["kept_max"] <= res["cache"]["bound_max"]
    with pytest.raises(ConfigError, match="streaming: method alibi"):
        eval_main(replace(cmd, method="alibi"))


def test_eval_init_evaluates_the_model_as_built(tmp_path, capsys):
    """``--checkpoint init``: the untrained model (no checkpoint needed), filed as
    ``eval-<split>-init.json`` beside, never over, the trained run's own evaluation."""
    cfg = tiny_cfg(tmp_path, method="alibi", steps=12, ckpt_interval=12)
    base = {f.name: getattr(cfg, f.name) for f in fields(TrainConfig)}
    cmd = EvalCommand(**base, checkpoint="init", progress=False)
    with pytest.raises(ConfigError, match="no checkpoint under"):
        eval_main(replace(cmd, checkpoint=None))
    assert eval_main(cmd) == 0
    init = json.loads((run_dir(cfg) / "eval-test-init.json").read_text())
    trained = train(cfg, progress=False, evaluate=True)
    assert eval_main(cmd) == 0                                       # again, after training: same numbers
    again = json.loads((run_dir(cfg) / "eval-test-init.json").read_text())
    print({k: (init["eval"][k]["ppl"], trained["eval"][k]["ppl"]) for k in init["eval"]})
    def numbers(ev):      # wall-clock "seconds" differ from call to call; the results may not
        return {k: {f: v for f, v in r.items() if f != "seconds"} for k, r in ev.items()}
    assert init["checkpoint"] == "init" and numbers(init["eval"]) == numbers(again["eval"])
    assert not (run_dir(cfg) / "eval-test.json").exists()
    assert all(init["eval"][k]["ppl"] > 1.5 * trained["eval"][k]["ppl"] for k in init["eval"])
