"""The 2-D op through the one backend registry: op "nd" with backends "torch" and "reference",
the Call a backend receives, the log-sum-exp of the reference backend, one-line errors for
backends that cannot serve a call, and degenerate inputs."""
import pytest
import torch

import poslsh
from poslsh.ops import load_backends, registry
from poslsh.partitions_nd import PartitionsND, grid_coords, sample_partitions_nd
from poslsh.reference import dense_attention, poslsh_attention_reference_nd

from inputs import make_qkv


def test_grid_backends_are_listed_and_auto_is_torch():
    q = torch.zeros(1, 2, 6, 4)
    assert poslsh.available_backends(op="nd")[:2] == ["torch", "reference"]
    assert poslsh.available_backends(q, op="nd")[:2] == ["torch", "reference"]
    assert registry.resolve("auto", "nd", q).name == "torch"
    assert "triton" not in poslsh.available_backends(op="nd")      # triton serves the 1-D ops only


def test_a_backend_receives_one_call_with_the_grid_and_the_partitions_on_q_device():
    """A backend registered for "nd" gets registry.Call(positional=PartitionsND, grid=(h, w)) and its
    answer is returned as is: the dispatcher adds nothing of its own."""
    load_backends()
    seen = []

    def spy(call):
        seen.append(call)
        return torch.full((*call.q.shape[:3], call.v.shape[-1]), 7.0, dtype=call.q.dtype), None

    registry.register_backend("spy-grid", spy, op="nd")
    try:
        q, k, v = make_qkv(2, 4, 2, 12, 8, dv=3)
        P = sample_partitions_nd(torch.tensor([1.0, 2.0, 3.0, 4.0]), 3, seed=0)
        out = poslsh.poslsh_attention_nd(q, k, v, P, grid=(3, 4), causal=True, backend="spy-grid")
    finally:
        registry._BACKENDS.pop("spy-grid")
    call, = seen
    assert call.grid == (3, 4) and call.causal is True and abs(call.scale - 8 ** -0.5) < 1e-16 and not call.return_lse
    assert call.positional == P and call.positional.device == q.device
    assert call.span is None and call.documents is None and call.shape.q_heads == 4 and call.shape.kv_heads == 2
    assert torch.equal(out, torch.full((2, 4, 12, 3), 7.0, dtype=torch.float64))
    assert "spy-grid" not in poslsh.available_backends(op="nd")


@pytest.mark.parametrize("causal", [False, True])
def test_reference_backend_is_the_oracle_and_gives_the_weighted_lse(causal):
    grid, n = (5, 7), 35
    q, k, v = make_qkv(2, 4, 2, n, 8, seed=3)
    P = sample_partitions_nd(torch.tensor([[0.7, 3.0], [2.0, 2.0], [9.0, 1.0], [30.0, 30.0]]), 4, seed=1)
    out, lse = poslsh.poslsh_attention_nd(q, k, v, P, grid=grid, causal=causal, backend="reference", return_lse=True)
    fast = poslsh.poslsh_attention_nd(q, k, v, P, grid=grid, causal=causal, backend="torch")
    assert torch.equal(out, poslsh_attention_reference_nd(q, k, v, P, grid=grid, causal=causal))
    assert (out - fast).abs().max().item() < 1e-12
    # lse_i = log sum_j count_ij e^{s_ij} (count not divided by s), by hand
    count = P.dense_count(grid_coords(*grid)).double()
    s = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(2, 1)) / 8 ** 0.5
    if causal:
        count = count * torch.ones(n, n, dtype=torch.float64).tril()
    by_hand = torch.log((count * s.exp()).sum(-1))
    assert lse.shape == (2, 4, n) and lse.dtype == torch.float64
    assert (lse - by_hand).abs().max().item() < 1e-12


def test_lse_needs_a_backend_that_has_it_one_line_each():
    q, k, v = make_qkv(1, 2, 2, 6, 4)
    P = sample_partitions_nd([1.0, 2.0], 2, seed=0)
    for backend, match in [("auto", r"backend='auto': no backend runs the 'nd' op on cpu / torch.float64 tensors, "
                                    r"the log-sum-exp \(return_lse=True\); these can if named: \['reference'\]"),
                           ("torch", r"backend='torch' cannot run this call: it does not support the log-sum-exp")]:
        with pytest.raises(ValueError, match=match) as err:
            poslsh.poslsh_attention_nd(q, k, v, P, grid=(2, 3), backend=backend, return_lse=True)
        assert "\n" not in str(err.value)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        poslsh.poslsh_attention_nd(q, k, v, P, grid=(2, 3), return_lse=1)


def test_degenerate_calls_keep_the_lse():
    P = sample_partitions_nd([1.0, 2.0], 2, seed=0)
    q, k, v = (torch.empty(3, 2, 6, 4, device="meta") for _ in range(3))
    out, lse = poslsh.poslsh_attention_nd(q, k, v, P, grid=(2, 3), backend="reference", return_lse=True)
    assert out.device.type == lse.device.type == "meta" and out.shape == (3, 2, 6, 4) and lse.shape == (3, 2, 6)
    q, k, v = make_qkv(1, 2, 2, 6, 4, dv=1)
    ref_out, ref_lse = poslsh.poslsh_attention_nd(q, k, v, P, grid=(2, 3), backend="reference", return_lse=True)
    out, lse = poslsh.poslsh_attention_nd(q, k, v[..., :0], P, grid=(2, 3), backend="reference", return_lse=True)
    assert out.shape == (1, 2, 6, 0) and torch.equal(lse, ref_lse)        # the weights do not depend on v


def test_grouped_boxes_on_the_fast_op_equal_the_oracle():
    """Correlated samplers per axis give ordinary boxes: the op needs nothing new for them."""
    q, k, v = make_qkv(1, 3, 3, 7 * 9, 8, seed=5)
    P = sample_partitions_nd(torch.tensor([1.0, 4.0, 12.0]), 9, seed=2, sampler="grouped")
    assert all(a.groups is not None and a.num_groups == 3 for a in P.axes)
    for causal in (False, True):
        out = poslsh.poslsh_attention_nd(q, k, v, P, grid=(7, 9), causal=causal)
        ref = poslsh_attention_reference_nd(q, k, v, P, grid=(7, 9), causal=causal)
        assert (out - ref).abs().max().item() < 1e-12


def test_packed_same_size_images_are_batch_rows():
    """Images of one size need no packing: each batch row is one grid, computed as if alone."""
    q, k, v = make_qkv(3, 2, 2, 12, 4, seed=8)
    P = PartitionsND.fixed_blocks(2, (2, 2))
    both = poslsh.poslsh_attention_nd(q, k, v, P, grid=(3, 4))
    one = poslsh.poslsh_attention_nd(q[1:2], k[1:2], v[1:2], P, grid=(3, 4))
    assert torch.equal(both[1:2], one)
    ids = P.block_ids(grid_coords(3, 4))[0, 0]
    assert (both - dense_attention(q, k, v, allowed=ids[:, None] == ids[None])).abs().max().item() < 1e-13
