"""``torch.compile`` (inductor, fullgraph) of every torch-backend custom op, module and Hugging Face
scheme on the layout models produce: q, k, v as ``[B, n, H, d] -> transpose(1, 2)`` views, forward
and backward against eager (float32: output within 1e-6, gradients within 1e-5).

Inductor checks every custom op's output strides against its fake (meta) kernel: a fake that
returns the input's strides where the real op returns contiguous tensors fails there, so these
tests run inductor, not aot_eager; ``opcheck`` checks the same fake-versus-real agreement on
transposed inputs for each op directly. Inductor's caches start empty here (one fresh cache for
the module): a cached compilation of an earlier version of the ops would hide a changed fake kernel.
"""
import shutil

import pytest
import torch

import poslsh
from poslsh.ops.torch import grid as torch_grid, ops as torch_ops

from inputs import assert_compiles_like_eager

pytestmark = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                reason="inductor on CPU needs a C++ compiler")
B, HQ, HKV, N, D = 2, 4, 2, 97, 8
OUT_TOL, GRAD_TOL = 1e-6, 1e-5
SLOPES = poslsh.alibi_slopes(HQ)
WINDOWS = torch.tensor([0, 3, 20, 200])


@pytest.fixture(autouse=True, scope="module")
def fresh_inductor_cache():
    poslsh.available_backends()   # backends register on first use: not inside a trace
    from torch._inductor.utils import fresh_cache
    with fresh_cache():
        yield


def _leaves(b=B, n=N, heads=(HQ, HKV, HKV), seed=0):
    """q, k, v as leaves in the models' ``[B, n, H, d]`` layout (the op sees their transposes)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, h, D, generator=g).requires_grad_() for h in heads]


def _heads_first(*xs):
    return [x.transpose(1, 2) for x in xs]


def _with_lse(result):
    out, lse = result
    return torch.cat([out.flatten(), lse.flatten()])


def _documents(kind):
    if kind is None:
        return {}
    if kind == "cu":
        return {"cu_seqlens": torch.tensor([0, 1, 40, 41, N])}
    ids = torch.zeros(B, N, dtype=torch.int64)
    ids[0, 30:], ids[1, 5:], ids[1, 60:] = 1, 1, 2
    return {"document_ids": ids}


@pytest.mark.parametrize("op,docs", [
    ("sequence", None), ("window", None), ("sequence", "ids"), ("window", "cu"),
    pytest.param("sequence", "cu", marks=pytest.mark.slow), pytest.param("window", "ids", marks=pytest.mark.slow)])
def test_ops_compiled_like_eager_on_transposed_views(op, docs):
    """Both 1-D ops, causal, GQA, with the lse (its gradient too); packed documents with
    ``cu_seqlens`` (one row) and ``document_ids`` (rows packed differently) under fullgraph."""
    kw = _documents(docs)
    b = 1 if docs == "cu" else B
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(HQ) * 2, 4, seed=1)

    def fn(q, k, v):
        q, k, v = _heads_first(q, k, v)
        if op == "sequence":
            return _with_lse(poslsh.poslsh_attention(q, k, v, parts, causal=True, return_lse=True, **kw))
        return _with_lse(poslsh.windowed_alibi_attention(q, k, v, SLOPES, window=WINDOWS, causal=docs is None,
                                                         return_lse=True, **kw))

    assert_compiles_like_eager(fn, *_leaves(b), backend="inductor", out_tol=OUT_TOL, grad_tol=GRAD_TOL)


def test_grid_op_compiled_like_eager_on_transposed_views():
    parts = poslsh.sample_partitions_nd(poslsh.alibi_sigmas(HQ), 3, dims=2, seed=2)

    def fn(q, k, v):
        return poslsh.poslsh_attention_nd(*_heads_first(q, k, v), parts, grid=(8, 12), causal=True)

    assert_compiles_like_eager(fn, *_leaves(n=96), backend="inductor", out_tol=OUT_TOL, grad_tol=GRAD_TOL)


@pytest.mark.parametrize("dims", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_module_compiled_like_eager(dims):
    """PoslshAttention with projections (its own transposes), training mode, gradients of the
    input and of every weight."""
    torch.manual_seed(0)
    module = poslsh.PoslshAttention(32, HQ, num_kv_heads=HKV, num_samples=4, dims=dims).train()
    x = torch.randn(B, 96, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    weights = [p for p in module.parameters()]
    grid = (8, 12) if dims == 2 else None

    def fn(x, *_):
        return module(x, step=3, grid=grid)

    # fullgraph: the draw of a step's partitions is one custom op (poslsh::schedule_draw)
    assert_compiles_like_eager(fn, x, *weights, backend="inductor", out_tol=OUT_TOL, grad_tol=GRAD_TOL)


@pytest.mark.parametrize("op,name", [("sequence", "fwd"), ("sequence", "bwd"), ("window", "fwd"), ("window", "bwd"),
                                     ("grid", "fwd"), ("grid", "bwd")])
def test_custom_ops_fake_kernels_match_real_ones_on_transposed_inputs(op, name):
    """``opcheck``: every custom op's fake kernel gives the real op's shapes, dtypes and strides
    on non-contiguous inputs (the strides inductor asserts), forward and backward."""
    q, k, v = (x.detach().requires_grad_() for x in _heads_first(*_leaves(n=40)))
    if op == "grid":
        parts = poslsh.sample_partitions_nd(poslsh.alibi_sigmas(HQ), 3, dims=2, seed=2)
        extra = (parts.widths, parts.offsets, [5, 8], True, 0.3)
        fwd, bwd = torch_grid.torch_attention_2d_fwd, torch_grid.torch_attention_2d_bwd
    else:
        a, b_ = (poslsh.sample_partitions(poslsh.alibi_sigmas(HQ), 3, seed=0).widths,
                 poslsh.sample_partitions(poslsh.alibi_sigmas(HQ), 3, seed=0).offsets) if op == "sequence" else \
            (SLOPES, WINDOWS)
        fwd, bwd = ((torch_ops.torch_attention_fwd, torch_ops.torch_attention_bwd) if op == "sequence" else
                    (torch_ops.torch_window_fwd, torch_ops.torch_window_bwd))
    if name == "fwd":
        args = (q, k, v, *extra) if op == "grid" else (q, k, v, a, b_, None, None, True, 0.3, True, [0, 0, 40])
        torch.library.opcheck(fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
        return
    with torch.no_grad():
        args = (q, k, v, *extra) if op == "grid" else (q, k, v, a, b_, None, None, True, 0.3, True, [0, 0, 40])
        out, lse = fwd(*args)
    dout = torch.randn(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).transpose(1, 2)   # not contiguous
    if op == "grid":
        args = (dout, q.detach(), k.detach(), v.detach(), lse, *extra)
    else:
        args = (dout, q.detach(), k.detach(), v.detach(), lse, torch.ones_like(lse), a, b_, None, None, True, 0.3,
                [0, 0, 40])
    torch.library.opcheck(bwd, args, test_utils=("test_schema", "test_faketensor"))



@pytest.mark.parametrize("scheme", [pytest.param("poslsh", marks=pytest.mark.slow), "alibi-window"])
def test_hf_training_step_compiled_like_eager(scheme):
    """A compiled training step of a tiny Qwen3 (GQA) with the scheme: loss and every parameter's
    gradient equal eager's (transformers' attention hands the op transposed views)."""
    tf = pytest.importorskip("transformers")
    from poslsh.integrations import hf

    cfg = tf.Qwen3Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=256,
                         attention_dropout=0.0)
    torch.manual_seed(0)
    params = dict(num_samples=3) if scheme == "poslsh" else dict(window_sigmas=2.0)
    model = hf.model_from_config(cfg, scheme, **params).train()
    x = torch.randint(0, 61, (2, 45), generator=torch.Generator().manual_seed(1))
    step = {"poslsh_step": 7} if scheme == "poslsh" else {}

    def loss(*weights):
        return model(x, labels=x, use_cache=False, **step).loss

    weights = list(model.parameters())
    # (not fullgraph: transformers' mask code and the partitions' seed hash break the graph)
    assert_compiles_like_eager(loss, *weights, backend="inductor", out_tol=OUT_TOL, grad_tol=GRAD_TOL,
                               fullgraph=False)
