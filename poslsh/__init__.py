"""poslsh: positional-LSH attention (Wolfson & Wagner), a near-linear approximation
of ALiBi attention by random contiguous block masks, and its strongest rival, exact ALiBi cut at
per-head windows (:mod:`poslsh.window`).

The names here are the ones a model builder calls; the plumbing stays in its submodule
(``poslsh.alibi``, ``poslsh.partitions``, ``poslsh.partitions_nd``, ``poslsh.reference``,
``poslsh.documents``, ``poslsh.window``, ``poslsh.decoding``, ...). Vocabulary: the ops and modules
take ALiBi's ``slopes``, the samplers, cost and theory the bandwidth ``sigma = 1 / slopes``; each takes
the other word by keyword.
"""
from .alibi import alibi_sigmas, alibi_slopes
from .attention import attend, available_backends, poslsh_attention, poslsh_attention_nd
from .merge import merge_attention
from .partitions import Partitions, sample_partitions
from .partitions_nd import PartitionsND, sample_partitions_nd
from .reference import alibi_attention, poslsh_attention_reference
from .widths import FixedWidth, GammaWidths
from .window import AlibiWindow, windowed_alibi_attention
from . import cost, theory, window
from .modules import AlibiAttention, PartitionSchedule, PoslshAttention

__version__ = "0.2.0"

__all__ = [
    # ALiBi and its bandwidths
    "alibi_slopes", "alibi_sigmas",
    # the positional objects and their samplers
    "Partitions", "sample_partitions", "PartitionsND", "sample_partitions_nd", "AlibiWindow", "GammaWidths",
    "FixedWidth",
    # the ops (near-linear) and the float64 oracles
    "attend", "poslsh_attention", "windowed_alibi_attention", "poslsh_attention_nd", "alibi_attention",
    "poslsh_attention_reference", "merge_attention", "available_backends",
    # modules
    "PoslshAttention", "AlibiAttention", "PartitionSchedule",
    # cost and theory
    "cost", "theory", "window",
]

# ---------------------------------------------------------------- names of 0.2, for one release
from . import alibi as _alibi, attention as _attention  # noqa: E402
from . import documents as _documents, reference as _reference  # noqa: E402
from . import partitions as _partitions, partitions_nd as _partitions_nd  # noqa: E402
from ._compat import moved_names as _moved_names  # noqa: E402


def _from(module, name, path):
    return (lambda: getattr(module, name)), f"{path}.{name}"


_moved_names(globals(), {
    **{n: _from(_alibi, n, "poslsh.alibi") for n in ("alibi_bias", "alibi_matrix")},
    **{n: _from(window, n, "poslsh.window") for n in ("make_window",)},
    **{n: _from(_partitions, n, "poslsh.partitions") for n in ("Blocks",)},
    **{n: _from(_documents, n, "poslsh.documents") for n in ("Documents",)},
    **{n: _from(_partitions_nd, n, "poslsh.partitions_nd") for n in ("grid_coords", "expected_mask")},
    **{n: _from(_reference, n, "poslsh.reference") for n in ("alibi_bias_nd", "alibi_matrix_nd", "alibi_attention_nd",
                                                           "kernel_attention_nd", "poslsh_attention_reference_nd")},
    "poslsh_attention_2d": (lambda: _attention.poslsh_attention_2d,
                            "poslsh.poslsh_attention_nd (grid= keyword-only)"),
})
_moved_names(vars(_alibi), {"AlibiWindow": (lambda: AlibiWindow, "poslsh.AlibiWindow (poslsh.window.AlibiWindow)"),
                            "make_window": _from(window, "make_window", "poslsh.window")})
_moved_names(vars(cost), {n: _from(window, n, "poslsh.window") for n in ("cost_matched_window", "window_keys_per_query")})
_moved_names(vars(_attention), {"windowed_alibi_attention": (lambda: windowed_alibi_attention,
                                                             "poslsh.windowed_alibi_attention (poslsh.window)")})

# Register every backend now, not at the first call: a first call inside torch.compile would
# otherwise import modules while dynamo traces (a graph break, an error under fullgraph=True).
from .ops import load_backends as _load_backends  # noqa: E402

_load_backends()
