"""A compiled training step of a tiny Hugging Face model equals the eager one under the ``alibi`` and
``fixed_blocks`` schemes: torch.compile of forward and backward (q, k, v the transposed ``[B, n, H, d]``
views of the model's projections), loss and every parameter's gradient. Graph breaks are allowed: the
integration looks at the position ids for packed documents and checks partitions it builds (data-dependent
branches); the attention itself is traced (``fixed_blocks``: the torch backend's custom op; ``alibi``:
exact ALiBi, dense like stock sdpa)."""
import pytest
import torch

pytest.importorskip("transformers")

from poslsh.integrations import hf  # noqa: E402
from test_hf import ids, tiny_config  # noqa: E402

from inputs import assert_compiles_like_eager  # noqa: E402


@pytest.mark.parametrize("scheme", ["alibi", "fixed_blocks"])
def test_compiled_training_step_equals_eager(scheme):
    torch.manual_seed(0)
    model = hf.model_from_config(tiny_config(num_hidden_layers=1), scheme, block_size=5).double().train()
    x = ids(B=2, n=37)
    params = [p for p in model.parameters() if p.requires_grad]

    def loss(*weights):
        return model(input_ids=x, labels=x, use_cache=False).loss
    assert_compiles_like_eager(loss, *params, fullgraph=False)
