"""The Hugging Face integration without transformers, or with one too old: one line each."""
import subprocess
import sys
import warnings

import pytest

import poslsh.integrations as integrations


def _import_hf_with(fake_transformers: str):
    """Import poslsh.integrations.hf in a fresh interpreter after ``fake_transformers`` (source)
    has put a stand-in for transformers in ``sys.modules`` (None: not installed): (rc, stderr lines)."""
    code = f"import sys, types\n{fake_transformers}\nfrom poslsh.integrations import hf\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return r.returncode, r.stderr.strip().splitlines()


def test_missing_transformers_says_what_to_install():
    rc, err = _import_hf_with("sys.modules['transformers'] = None")
    assert rc == 1
    assert err[-1] == ('ModuleNotFoundError: poslsh.integrations.hf needs transformers: pip install "transformers>='
                       f'{integrations.MIN_TRANSFORMERS}" safetensors (the [hf] extra of poslsh)')


def test_too_old_transformers_names_both_versions():
    fake = "m = types.ModuleType('transformers'); m.__version__ = '4.57.6'; sys.modules['transformers'] = m"
    rc, err = _import_hf_with(fake)
    assert rc == 1
    assert err[-1].startswith("ImportError: poslsh.integrations.hf needs transformers >= "
                              f"{integrations.MIN_TRANSFORMERS}, found 4.57.6")


def test_the_extra_and_the_floor_agree():
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path
    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    hf = meta["project"]["optional-dependencies"]["hf"]
    assert f"transformers>={integrations.MIN_TRANSFORMERS},<{integrations.BELOW_TRANSFORMERS}" in hf, hf


def test_past_the_tested_range_patch_alibi_warns_in_one_line(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from poslsh.integrations.hf import patch_alibi
    model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=16, hidden_size=8, n_layer=1, n_head=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_alibi(model)                                      # the installed release is in the range
    monkeypatch.setattr(transformers, "__version__", "9.0.0")
    with pytest.warns(integrations.UntestedTransformersWarning) as caught:
        patch_alibi(model)
    (line,) = [str(w.message) for w in caught]
    assert "\n" not in line and "found 9.0.0" in line and integrations.BELOW_TRANSFORMERS in line
