"""Claims of the README and docs/ that a file of this repository decides: the measured conversion of
a pretrained RoPE model (results/conversion/smollm2.json) and how to install without a release."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_conversion_numbers_are_the_measured_ones():
    """A converted pretrained model needs fine-tuning: the README, docs/huggingface.md and
    paper/RESULTS.md quote the losses of results/conversion/smollm2.json (SmolLM2-135M before any
    training)."""
    models = json.loads((ROOT / "results" / "conversion" / "smollm2.json").read_text())["models"]
    loss = {name: m["loss"] for name, m in models.items()}
    converted = [loss[s] for s in ("alibi", "alibi-window", "poslsh")]
    readme = (ROOT / "README.md").read_text()
    assert f"loss {loss['original']:.2f} → {min(converted):.1f}–{max(converted):.1f}" in readme
    hf = " ".join((ROOT / "docs" / "huggingface.md").read_text().split())
    assert f"rises from {loss['original']:.2f} to {min(converted):.1f}–{max(converted):.1f}" in hf
    results = (ROOT / "paper" / "RESULTS.md").read_text()
    for name, label in (("original", "original (RoPE)"), ("alibi", "`alibi`"), ("poslsh", "`poslsh` (s = 10)")):
        assert f"| {label} | {loss[name]:.2f} |" in results, name
    assert "must be fine-tuned" in readme and "needs fine-tuning" in hf


def test_the_install_text_names_no_release():
    """No package index has poslsh yet: the README installs from a checkout, never `pip install poslsh`."""
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install"):readme.index("## Usage")]
    assert "pip install poslsh" not in readme and "No release is on a package index yet" in install
    assert '`".[hf]"`' in install and "python -m build" in install
