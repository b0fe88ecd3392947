"""The public op's contract: dispatch and clear errors on bad input."""
import pytest
import torch

import poslsh

from inputs import LargestTensor, alibi_partitions, make_qkv


def test_backends_listed_and_auto_runs():
    assert {"torch", "reference"} <= set(poslsh.available_backends())
    q, k, v = make_qkv(1, 4, 2, 20, 8)
    P = alibi_partitions(4, 3)
    assert torch.allclose(poslsh.poslsh_attention(q, k, v, P), poslsh.poslsh_attention(q, k, v, P, backend="reference"))


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v: (q[0], k, v), "must have shape"),
    (lambda q, k, v: (q, k[..., :4], v), "head_dim"),
    (lambda q, k, v: (q, k, v[:, :, :5]), "must agree"),
    (lambda q, k, v: (q[:, :, :5], k, v), "seqlen"),
    (lambda q, k, v: (q, k.float(), v), "dtype"),
    (lambda q, k, v: (q.long(), k, v), "float16, bfloat16"),
    (lambda q, k, v: (q, k.repeat(1, 2, 1, 1)[:, :3], v.repeat(1, 2, 1, 1)[:, :3]), "multiple of key/value heads"),
    (lambda q, k, v: (q[:1], k, v), "batch size"),
    (lambda q, k, v: (q.to("meta"), k, v), "one device"),
    (lambda q, k, v: ("q", k, v), "torch.Tensor"),
])
def test_bad_input_gets_clear_error(mutate, match):
    q, k, v = make_qkv(2, 4, 2, 12, 8)
    P = alibi_partitions(4, 2)
    with pytest.raises((ValueError, TypeError), match=match):
        poslsh.poslsh_attention(*mutate(q, k, v), P)


def test_bad_partitions_scale_backend():
    q, k, v = make_qkv(1, 4, 2, 12, 8)
    with pytest.raises(ValueError, match="partitions were built for 8 heads but q has 4"):
        poslsh.poslsh_attention(q, k, v, alibi_partitions(8, 2))
    with pytest.raises(TypeError, match="Partitions"):
        poslsh.poslsh_attention(q, k, v, torch.ones(4, 2))
    with pytest.raises(ValueError, match="scale"):
        poslsh.poslsh_attention(q, k, v, alibi_partitions(4, 2), scale=float("nan"))
    with pytest.raises(ValueError, match="unknown backend"):
        poslsh.poslsh_attention(q, k, v, alibi_partitions(4, 2), backend="cuda-magic")


def test_no_quadratic_tensor_on_torch_path(monkeypatch):
    """Every tensor created inside the torch backend is O(n) in size (n = 4096 here)."""
    import poslsh.ops.torch.tiles as ti

    n = 4096
    q, k, v = make_qkv(1, 2, 1, n, 8, dtype=torch.float32)
    P = poslsh.sample_partitions(torch.tensor([4.0, 64.0]), 4, seed=0)
    monkeypatch.setattr(ti, "CHUNK_ELEMENTS", 1 << 16)
    with LargestTensor() as watch:
        out = poslsh.poslsh_attention(q, k, v, P, causal=True, backend="torch")
    largest = watch.largest
    print("largest tensor elements", largest, "n^2 =", n * n)
    assert torch.isfinite(out).all()
    assert largest < n * n // 16


def test_first_ever_call_may_be_inside_torch_compile():
    """The backends register at import: a process whose first call of the op is being traced by
    torch.compile(fullgraph=True) compiles (no module import while dynamo traces)."""
    import subprocess
    import sys
    code = ("import torch, poslsh\n"
            "q = torch.randn(1, 2, 40, 8)\n"
            "parts = poslsh.sample_partitions(poslsh.alibi_sigmas(2), 3, seed=0)\n"
            "f = torch.compile(lambda q: poslsh.poslsh_attention(q, q, q, parts, causal=True), fullgraph=True)\n"
            "ref = poslsh.poslsh_attention_reference(q.double(), q.double(), q.double(), parts, causal=True)\n"
            "assert (f(q).double() - ref).abs().max() < 1e-5\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_backend_this_installation_lacks_says_what_it_needs():
    """backend="triton" without triton: what it needs, not "unknown backend"; a misspelt name stays unknown."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, poslsh\n"
            "q = torch.randn(1, 2, 5, 4)\n"
            "for name in ('triton', 'tritn'):\n"
            "    try:\n"
            "        poslsh.windowed_alibi_attention(q, q, q, poslsh.alibi_slopes(2), window=2, backend=name)\n"
            "    except ValueError as e:\n"
            "        print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("backend='triton' is not available here: it needs triton, which is not installed "
                               "(pip install \"triton>=3.4\", the [triton] extra of poslsh)"), lines
    assert lines[1].startswith("backend: unknown backend 'tritn'"), lines
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path
    from poslsh.ops import TRITON_REQUIREMENT
    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert meta["project"]["optional-dependencies"]["triton"] == [TRITON_REQUIREMENT]
