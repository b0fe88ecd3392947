"""The library as a user gets it: a wheel that needs torch alone, imports without the app's
libraries, runs the op and its backward; one version; the app distribution beside it."""
import importlib.metadata as md
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = ("matplotlib", "tqdm", "tyro", "transformers", "peft", "numpy", "scipy", "poslsh_paper", "triton")

SMOKE = r"""
import sys, torch, poslsh
q = torch.randn(1, 4, 97, 16, requires_grad=True)
k = torch.randn(1, 2, 97, 16, requires_grad=True)
v = torch.randn(1, 2, 97, 16, requires_grad=True)
parts = poslsh.sample_partitions(poslsh.alibi_sigmas(4), 5, seed=0)
out = poslsh.poslsh_attention(q, k, v, parts, causal=True)
out.square().sum().backward()
ref = poslsh.poslsh_attention_reference(q.double(), k.double(), v.double(), parts, causal=True)
assert (out.double() - ref).abs().max() < 1e-5 and q.grad.abs().sum() > 0
layer = poslsh.PoslshAttention(32, 4, num_samples=3)
layer(torch.randn(2, 9, 32)).sum().backward()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
print("LOADED", loaded)
print("FILE", poslsh.__file__)
"""


def _torch_only_dir(dest: Path) -> Path:
    """A directory holding only torch and what it requires (links into this environment)."""
    dest.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        name = re.split(r"[\s<>=!~;\[]", todo.pop())[0].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        dist = md.distribution(name)
        todo += [r for r in (dist.requires or []) if "extra ==" not in r]
        for f in dist.files or []:
            top = f.parts[0]
            src = Path(dist.locate_file(top))
            if ".." not in f.parts and src.exists() and not (dest / top).exists() and not top.endswith(".pth"):
                (dest / top).symlink_to(src)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(out), str(REPO)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "deprecat" not in (r.stdout + r.stderr).lower(), "the build warned: " + (r.stdout + r.stderr)[-2000:]
    (path,) = out.glob("poslsh-*.whl")
    return path


def test_wheel_needs_torch_alone_and_imports_no_app_library(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "torch_only.pth").write_text(str(_torch_only_dir(tmp_path / "torch_only")) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, timeout=300)
    probe = [str(py), "-c", f"FORBIDDEN = {FORBIDDEN!r}\n" + SMOKE]
    r = subprocess.run(probe, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    assert "LOADED []" in r.stdout
    assert str(site) in r.stdout.split("FILE")[1]                 # the installed wheel, not the checkout
    meta = md.Distribution.at(next(site.glob("poslsh-*.dist-info")))
    hard = [r for r in meta.requires if "extra ==" not in r]
    assert hard == ["torch>=2.4"], hard
    assert (site / "poslsh" / "py.typed").exists() and not (site / "poslsh_paper").exists()
    assert meta.metadata["License-Expression"] == "Apache-2.0"
    assert any(f.name == "LICENSE" and "licenses" in f.parts for f in meta.files), "the wheel carries no LICENSE"


def test_one_version():
    import poslsh
    import poslsh_paper
    assert md.version("poslsh") == poslsh.__version__ == poslsh_paper.__version__
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert f"## {poslsh.__version__}" in changelog
