"""A converted model saved with save_pretrained carries its scheme: plain
AutoModelForCausalLM.from_pretrained (poslsh imported) gives the saved model's logits, also after
a second save; without poslsh it refuses loudly (a subprocess); built with another attention
implementation it refuses; configs convert back and forth; older checkpoints still load."""
import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from poslsh.integrations import hf  # noqa: E402

BACKEND = "auto"
H, KV, D, VOCAB = 4, 2, 8, 61
SCHEMES = {"poslsh": dict(num_samples=4, seed=3, eval_seed=5), "fixed_blocks": dict(block_size=6), "alibi": {},
           "alibi-window": dict(window_cost_samples=3, backend=BACKEND)}
FAMILIES = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
            "mistral": transformers.MistralConfig}


def tiny_config(family="llama"):
    return FAMILIES[family](vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=H, num_key_value_heads=KV, head_dim=D, attention_dropout=0.0,
                            max_position_embeddings=256)


def saved(tmp_path, scheme, family="llama"):
    torch.manual_seed(0)
    model = hf.model_from_config(tiny_config(family), scheme, **SCHEMES[scheme]).to(torch.float64).eval()
    path = tmp_path / f"{family}-{scheme}"
    model.save_pretrained(path)
    return model, path


def ids(n=33):
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


def plain_load(path, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, local_files_only=True,
                                                             **kw).eval()


@pytest.mark.parametrize("scheme,family", [(s, "llama") for s in SCHEMES] + [("poslsh", "qwen3"),
                                                                            ("poslsh", "mistral")])
def test_plain_from_pretrained_is_the_saved_model(scheme, family, tmp_path):
    model, path = saved(tmp_path, scheme, family)
    written = json.loads((path / "config.json").read_text())
    assert written["attn_implementation"] == scheme
    assert written["rope_parameters"]["rope_type"] == hf.NO_ROTATION
    assert written["poslsh"]["scheme"] == scheme
    x = ids()
    with torch.no_grad():
        want = model(x).logits
        loaded = plain_load(path)
        got = loaded(x).logits
    assert loaded.config._attn_implementation == scheme
    assert hf.positional_config(loaded.config) == hf.positional_config(model.config)
    assert float((got - want).abs().max()) < 1e-12
    # saved again by plain transformers: still the same model
    loaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["attn_implementation"] == scheme
    with torch.no_grad():
        assert float((plain_load(tmp_path / "again")(x).logits - want).abs().max()) < 1e-12


def test_without_poslsh_plain_loading_refuses_loudly(tmp_path):
    paths = {scheme: saved(tmp_path, scheme)[1] for scheme in SCHEMES}
    script = f"""
import sys, torch, transformers
for scheme, path in {dict((s, str(p)) for s, p in paths.items())!r}.items():
    try:
        transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except Exception as e:
        print(scheme, "|", type(e).__name__, "|", str(e).splitlines()[0])
    else:
        print(scheme, "| loaded")
print("poslsh imported:", any(m == "poslsh" or m.startswith("poslsh.") for m in sys.modules))
"""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    print(run.stdout, run.stderr[-2000:])
    lines = dict(line.split(" | ", 1) for line in run.stdout.splitlines() if " | " in line)
    assert "poslsh imported: False" in run.stdout
    for scheme in SCHEMES:
        assert lines[scheme].startswith("ValueError | "), lines[scheme]
        assert f'attn_implementation="{scheme}"` is not supported' in lines[scheme]


def test_another_attention_implementation_is_refused(tmp_path):
    _, path = saved(tmp_path, "poslsh")
    with pytest.raises(ValueError, match="positional scheme is 'poslsh'.*attn_implementation='sdpa'"):
        plain_load(path, attn_implementation="sdpa")
    assert hf.from_pretrained(path).config._attn_implementation == "poslsh"


def test_configs_convert_back_to_the_original():
    cfg = hf.apply_positional_scheme(tiny_config(), "alibi")
    assert cfg.rope_parameters["rope_type"] == hf.NO_ROTATION and cfg.attn_implementation == "alibi"
    back = hf.apply_positional_scheme(cfg, "original")
    assert back.rope_parameters["rope_type"] == "default" and "replaced_rope_type" not in back.rope_parameters
    assert "attn_implementation" not in back.to_dict()
    model = hf.model_from_config(back)
    assert type(model.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
    assert bool((model.model.rotary_emb.inv_freq != 0).all())
    removed = hf.model_from_config(cfg)
    with pytest.raises(ValueError, match="RoPE was removed"):
        hf.apply_positional_scheme(removed, "original")


def test_older_checkpoints_load_with_hf_from_pretrained(tmp_path):
    """Saved before the config carried the scheme (RoPE type kept, no attn_implementation):
    hf.from_pretrained still restores it (plain loading gives the RoPE + sdpa model)."""
    model, path = saved(tmp_path, "poslsh")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    del cfg["attn_implementation"]
    (path / "config.json").write_text(json.dumps(cfg))
    x = ids()
    with torch.no_grad():
        want = model(x).logits
        assert float((hf.from_pretrained(path, dtype=torch.float64).eval()(x).logits - want).abs().max()) < 1e-12
        assert float((plain_load(path)(x).logits - want).abs().max()) > 1e-3
