"""poslsh: positional-LSH attention (Wolfson & Wagner), a near-linear approximation
of ALiBi attention by random contiguous block masks, and its strongest rival, exact ALiBi cut at
per-head windows (:mod:`poslsh.window`).

The names here are the ones a model builder calls; the plumbing stays in its submodule
(``poslsh.alibi``, ``poslsh.partitions``, ``poslsh.partitions_nd``, ``poslsh.reference``,
``poslsh.documents``, ``poslsh.window``, ``poslsh.decoding``, ...). Vocabulary: the ops, biases and
modules take ALiBi's ``slopes``, the samplers, cost and theory the bandwidth ``sigma``; converting is
explicit (:func:`alibi_sigmas`, ``1 / slopes``).
"""
from .alibi import alibi_sigmas, alibi_slopes
from .attention import attend, available_backends, poslsh_attention, poslsh_attention_nd
from .merge import merge_attention
from .partitions import Partitions, sample_partitions
from .partitions_nd import PartitionsND, sample_partitions_nd
from .reference import poslsh_attention_reference
from .widths import FixedWidth, GammaWidths
from .window import AlibiWindow
from .window.op import alibi_attention, windowed_alibi_attention
from . import cost, reference, theory, window
from .modules import AlibiAttention, PartitionSchedule, PoslshAttention

__version__ = "0.3.0"

__all__ = [
    # ALiBi and its bandwidths
    "alibi_slopes", "alibi_sigmas",
    # the positional objects and their samplers
    "Partitions", "sample_partitions", "PartitionsND", "sample_partitions_nd", "AlibiWindow", "GammaWidths",
    "FixedWidth",
    # the ops (near-linear) and the float64 oracle of positional LSH (every oracle: poslsh.reference)
    "attend", "poslsh_attention", "alibi_attention", "windowed_alibi_attention", "poslsh_attention_nd",
    "poslsh_attention_reference", "merge_attention", "available_backends",
    # modules
    "PoslshAttention", "AlibiAttention", "PartitionSchedule",
    # cost and theory
    "cost", "theory", "window",
]

# Register every backend now, not at the first call: a first call inside torch.compile would
# otherwise import modules while dynamo traces (a graph break, an error under fullgraph=True).
from .ops import load_backends as _load_backends  # noqa: E402

_load_backends()
