"""``poslsh train --context-parallel P``: each sequence split over P ranks (on a data x context
device mesh) trains the same model, with the same loss curve, as one process."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from poslsh_paper.cli import parse  # noqa: E402
from poslsh_paper.experiments.command import ConfigError  # noqa: E402
from poslsh_paper.experiments.checkpoints import load_checkpoint_params  # noqa: E402
from poslsh_paper.experiments.lm.commands import COMMANDS  # noqa: E402
from poslsh_paper.experiments.lm.config import check, get_preset, run_dir  # noqa: E402
from poslsh_paper.experiments.lm.loop import train  # noqa: E402
from poslsh_paper.experiments.serialize import config_to_dict  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "distributed"))
from cp_harness import run_world  # noqa: E402
from cp_training_worker import train_worker  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def tiny(tmp_path, name, cache, **kw):
    """A 2-layer model (4 query / 2 key-value heads) on the synthetic corpus, 4 steps of 4 x 30 tokens."""
    base = get_preset("smoke")
    return replace(base, data=replace(base.data, corpora=("synthetic",), tokenizer="bpe:300", synthetic_docs=150),
                   model=replace(base.model, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                                 intermediate_size=64),
                   runs_dir=str(tmp_path / name), cache_dir=str(cache), method="poslsh-s3", seq_len=30,
                   batch_size=4, micro_batch_size=2, steps=4, ckpt_interval=4, eval_tokens=128, eval_batch_tokens=256,
                   eval_multipliers=(1,), lr=3e-3, threads=1, **kw)


def final(cfg):
    path = run_dir(cfg) / "checkpoints" / f"step-{cfg.steps:08d}"
    return load_checkpoint_params(path), json.loads((path / "state.json").read_text())["history"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp-train")
    one = tiny(tmp, "one", tmp / "cache")
    train(one, progress=False)
    return tmp, one, final(one)


@pytest.mark.parametrize("world,context", [(3, 3), (4, 2)], ids=["P3-uneven-shards", "mesh-2x2"])
def test_loss_curve_and_weights_equal_one_process(single, world, context):
    """3 ranks: shards of 10 tokens each for 30 (targets cross the shard ends); 4 ranks: a 2 x 2
    mesh, 2 replicas x 2 shards of 15. Same math as one process, other summation order:
    float32 noise only."""
    tmp, one, (want_params, want_hist) = single
    cfg = tiny(tmp, f"cp{world}", tmp / "cache", context_parallel=context)
    res = run_world(world, train_worker, config_to_dict(cfg))
    got_params, got_hist = final(cfg)
    loss_err = max(abs(a[1] - b[1]) for a, b in zip(got_hist, want_hist))
    param_err = max(float((got_params[n] - want_params[n]).abs().max()) for n in want_params)
    ppl = (res[0]["eval"]["1x"]["ppl"], json.loads((run_dir(one) / "result.json").read_text())["eval"]["1x"]["ppl"])
    print(f"world {world} (context {context}): losses {[h[1] for h in got_hist]} vs one process "
          f"{[h[1] for h in want_hist]}: max |diff| {loss_err:.1e}; max |param diff| {param_err:.1e}; "
          f"eval ppl {ppl[0]:.5f} vs {ppl[1]:.5f}")
    assert [h[0] for h in got_hist] == [h[0] for h in want_hist] == [1, 2, 3, 4]
    assert loss_err <= 2e-5                       # the history keeps 5 decimals
    assert param_err <= 2e-5
    assert ppl[0] == pytest.approx(ppl[1], rel=1e-4)
    assert all(r["world_size"] == world for r in res)


def test_context_parallel_config_errors(tmp_path):
    cfg = tiny(tmp_path, "bad", tmp_path / "cache")
    train_cmd = {c.name: c for c in COMMANDS}["train"]
    assert parse(train_cmd, ["--context-parallel", "2"]).context_parallel == 2
    for bad, match in ((dict(method="alibi", context_parallel=2), "ring attention"),
                       (dict(context_parallel=0), "between 1 and seq_len"),
                       (dict(context_parallel=31), "between 1 and seq_len")):
        with pytest.raises(ConfigError, match=match):
            check(replace(cfg, **bad))
    with pytest.raises(ConfigError, match="must divide the world size 1"):
        train(replace(cfg, context_parallel=2), progress=False)


@pytest.mark.slow
def test_torchrun_cli(single):
    """The real launcher: ``torchrun --nproc_per_node 2 -m poslsh train --context-parallel 2``."""
    tmp, one, (want_params, want_hist) = single
    cfg = tiny(tmp, "torchrun", tmp / "cache", context_parallel=2)
    request = tmp / "torchrun.json"
    request.write_text(json.dumps(config_to_dict(cfg)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "poslsh_paper",
           "train", "--config-json", str(request), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "paper")])}
    # generous: a hang fails, a loaded machine does not
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got_params, got_hist = final(cfg)
    print("torchrun losses", got_hist, "one process", want_hist)
    assert max(abs(a[1] - b[1]) for a, b in zip(got_hist, want_hist)) <= 2e-5
    assert max(float((got_params[n] - want_params[n]).abs().max()) for n in want_params) <= 2e-5


def test_adapter_refuses_what_cannot_be_sharded():
    """``poslsh_context`` with a padding mask, or on exact ALiBi: one clear error, before any
    collective (so no process group is needed to see it)."""
    import transformers
    from poslsh.distributed import ContextShard
    from poslsh.integrations import hf

    cfg = transformers.Qwen3Config(vocab_size=31, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                                   max_position_embeddings=64, attention_dropout=0.0)
    x = torch.randint(0, 31, (2, 9), generator=torch.Generator().manual_seed(0))
    shard = ContextShard(None, 0, 9)
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[0, :3] = 0                                    # left padding: a real mask reaches attention
    with pytest.raises(ValueError, match="unpadded sequences only"):
        hf.model_from_config(cfg, "poslsh", num_samples=2).eval()(x, attention_mask=pad, poslsh_context=shard)
    with pytest.raises(ValueError, match="exact ALiBi cannot run context-parallel"):
        hf.model_from_config(cfg, "alibi").eval()(x, poslsh_context=shard)
