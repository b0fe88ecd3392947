"""PartitionSchedule (the one training / evaluation partition rule) and PoslshAttention (the
drop-in module), against the op and the seeding rule they are made of."""
import sys
from pathlib import Path

import pytest
import torch

import poslsh
from poslsh.seeding import stable_seed

from inputs import make_qkv

BACKEND = "auto"


def test_schedule_fresh_per_step_fixed_in_eval_and_cached():
    sched = poslsh.PartitionSchedule(poslsh.alibi_sigmas(4), 5, layer=3, seed=7, eval_seed=11)
    a, b = sched.partitions(True, 0), sched.partitions(True, 1)
    assert a != b and sched.partitions(True, 1) is b                        # fresh per step, cached
    want = poslsh.sample_partitions(poslsh.alibi_sigmas(4), 5, seed=stable_seed("train", 7, 1, 3, 4, 5))
    assert b == want                                                        # the documented seed
    e = sched.partitions(False)
    assert e is sched.partitions(False) and e == poslsh.sample_partitions(
        poslsh.alibi_sigmas(4), 5, seed=stable_seed("eval", 11, 3, 4, 5))
    assert sched.partitions(True) == sched.partitions(True, 0) is not None   # no step: its own call count
    g = poslsh.PartitionSchedule(poslsh.alibi_sigmas(4), 8, sampler="grouped", group_size=4)
    assert g.partitions(True, 0).groups is not None and g.key(True, 0)[-2:] == ("grouped", 4)


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_samples"):
        poslsh.PartitionSchedule(poslsh.alibi_sigmas(2), 0)
    with pytest.raises(ValueError, match="sampler"):
        poslsh.PartitionSchedule(poslsh.alibi_sigmas(2), 3, sampler="nope")
    with pytest.raises(ValueError, match="step must be an int"):
        poslsh.PartitionSchedule(poslsh.alibi_sigmas(2), 3).partitions(True, -1)
    with pytest.raises(ValueError, match="dims must be 1"):
        poslsh.PartitionSchedule(poslsh.alibi_sigmas(2), 3, dims=3)


def test_grid_schedule_takes_every_sampler():
    """dims=2 draws grouped (and stratified) boxes, each axis on its own, under the documented seed:
    the grouped boxes run on the fast grid op like any others."""
    sched = poslsh.PartitionSchedule(poslsh.alibi_sigmas(3), 6, sampler="grouped", group_size=3, dims=2, layer=1)
    boxes = sched.partitions(True, 2)
    want = poslsh.sample_partitions_nd(poslsh.alibi_sigmas(3), 6, sampler="grouped", group_size=3,
                                       seed=stable_seed(*sched.key(True, 2)))
    assert boxes == want and all(a.groups is not None for a in boxes.axes)
    q, k, v = make_qkv(1, 3, 3, 20, 8)
    fast = poslsh.poslsh_attention_nd(q, k, v, boxes, grid=(4, 5), backend="torch")
    assert torch.allclose(fast, poslsh.reference.poslsh_attention_reference_nd(q, k, v, boxes, grid=(4, 5)), atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_module_with_projections_is_the_op(causal):
    torch.manual_seed(0)
    m = poslsh.PoslshAttention(24, 6, num_kv_heads=2, num_samples=4, causal=causal, layer=1, seed=3).double()
    x = torch.randn(2, 37, 24, dtype=torch.float64, requires_grad=True)
    out = m(x, step=5)
    q = m.q_proj(x).view(2, 37, 6, 4).transpose(1, 2)
    k = m.k_proj(x).view(2, 37, 2, 4).transpose(1, 2)
    v = m.v_proj(x).view(2, 37, 2, 4).transpose(1, 2)
    parts = m.schedule.partitions(True, 5)
    ref = poslsh.poslsh_attention_reference(q, k, v, parts, causal=causal)
    want = m.o_proj(ref.transpose(1, 2).reshape(2, 37, 24))
    assert torch.allclose(out, want, atol=1e-12)
    g1, = torch.autograd.grad(out.square().sum(), x)
    g2, = torch.autograd.grad(want.square().sum(), x)
    assert torch.allclose(g1, g2, atol=1e-10)
    m.eval()
    assert torch.equal(m(x), m(x)) and not torch.allclose(m(x), out)        # fixed eval partitions


@pytest.mark.parametrize("dims,sampler", [(1, "iid"), (1, "grouped"), pytest.param(2, "stratified",
                                                                                marks=pytest.mark.slow)])
def test_module_compiles_in_one_graph(dims, sampler):
    """torch.compile(PoslshAttention, fullgraph=True): training steps (the step symbolic after one
    recompile, not one graph per step) and evaluation give eager's outputs bitwise (the same
    partitions: the draw is one custom op with the eager seed); a fullgraph training call without
    step= is refused, naming step= (the module's own call count cannot live in a graph)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer = poslsh.PoslshAttention(32, 4, num_kv_heads=2, num_samples=3, dims=dims, sampler=sampler)
    x = torch.randn(2, 48, 32, generator=torch.Generator().manual_seed(0))
    grid = {"grid": (6, 8)} if dims == 2 else {}
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for step in range(4):
        assert torch.equal(compiled(x, step=step, **grid), layer(x, step=step, **grid)), step
    layer.eval()
    assert torch.equal(compiled(x, **grid), layer(x, **grid))
    print("graphs", counters["stats"]["unique_graphs"])
    assert counters["stats"]["unique_graphs"] == 3       # a constant step, a symbolic one, evaluation
    from poslsh.modules import schedule_draw           # its fake kernel gives the real shapes and dtypes
    torch.library.opcheck(schedule_draw, (layer.schedule.sigma, 3, "train:0:", 5, ":0:4:3", sampler, "", dims,
                                          torch.device("cpu")), test_utils=("test_schema", "test_faketensor"))
    layer.train()
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="step: under torch.compile a training PoslshAttention "
                       "needs step="):                 # fullgraph: dynamo reports the module's ValueError
        torch.compile(layer, fullgraph=True, backend="aot_eager")(x, **grid)


def test_module_without_projections_grids_and_documents():
    q, k, v = make_qkv(1, 4, 2, 12, 8)
    m = poslsh.PoslshAttention(num_heads=4, num_kv_heads=2, num_samples=3, causal=False).eval()
    parts = m.partitions()
    cu = torch.tensor([0, 5, 12])
    packed = poslsh.PoslshAttention(num_heads=4, num_kv_heads=2, num_samples=3, causal=False, backend=BACKEND).eval()
    assert torch.allclose(packed.attend(q, k, v, cu_seqlens=cu),
                          poslsh.poslsh_attention_reference(q, k, v, parts, cu_seqlens=cu), atol=1e-12)
    assert torch.allclose(m.attend(q, k, v), poslsh.poslsh_attention_reference(q, k, v, parts), atol=1e-12)
    grid = poslsh.PoslshAttention(num_heads=4, num_kv_heads=2, num_samples=3, dims=2, causal=False).eval()
    want = poslsh.reference.poslsh_attention_reference_nd(q, k, v, grid.partitions(), grid=(3, 4))
    assert torch.allclose(grid.attend(q, k, v, grid=(3, 4)), want, atol=1e-12)
    with pytest.raises(ValueError, match="grid=\\(height, width\\)"):
        grid.attend(q, k, v)
    with pytest.raises(ValueError, match="has no projections: call .attend\\(q, k, v\\)"):
        m(q)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        poslsh.PoslshAttention(8, 4, num_kv_heads=3)


def _docstring_command():
    """examples/tiny_gpt.py's module and the arguments of the command in its docstring."""
    import shlex
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples import tiny_gpt
    line = next(ln for ln in tiny_gpt.__doc__.splitlines() if ln.strip().startswith("python examples/tiny_gpt.py"))
    return tiny_gpt, shlex.split(line)[2:]


def test_example_command_of_the_docstring_reads_its_text(tmp_path, capsys):
    """The docstring's command parses and its --text is a UTF-8 text where it is installed (it was a
    README.rst that Debian ships gzipped); a gzipped text is read as its text, not as compressed bytes;
    a missing file is argparse's usage and one error line, exit 2."""
    import gzip
    tiny_gpt, args = _docstring_command()
    packed = tmp_path / "text.gz"
    packed.write_bytes(gzip.compress("the quick brown fox. ".encode() * 400))
    assert tiny_gpt.read_text(packed) == "the quick brown fox. ".encode() * 400
    with pytest.raises(SystemExit) as stop:
        tiny_gpt.main(["--steps", "2", "--text", str(tmp_path / "nope.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and "error: --text:" in err[-1] and "is not a file" in err[-1], err
    text = tiny_gpt.parser().parse_args(args).text
    if not text.is_file():
        pytest.skip(f"{text} (the docstring's text) is not installed here")
    tiny_gpt.read_text(text).decode("utf-8")


@pytest.mark.slow
def test_example_command_of_the_docstring_runs(tmp_path):
    """The docstring's command itself, with 2 steps (training, evaluation and a sample)."""
    import subprocess
    tiny_gpt, args = _docstring_command()
    args[args.index("--steps") + 1] = "2"
    if not tiny_gpt.parser().parse_args(args).text.is_file():
        pytest.skip("the docstring's text is not installed here")
    r = subprocess.run([sys.executable, tiny_gpt.__file__, *args], capture_output=True, text=True, timeout=900,
                       cwd=tmp_path)
    assert r.returncode == 0 and "held-out loss" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("attention", ["poslsh", "alibi-window"])
def test_example_model_trains_on_cpu(attention):
    """examples/tiny_gpt.py (docs/model.md): the loss of a tiny model falls on a repetitive text, on
    positional LSH and on the ALiBi window."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.tiny_gpt import GPTConfig, train
    cfg = GPTConfig(block_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, num_samples=4, attention=attention)
    data = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 40), dtype=torch.long)
    _, losses = train(cfg, data, steps=40, batch=4, log_every=0)
    print(losses[:3], losses[-3:])
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
