"""poslsh: positional-LSH attention (Wolfson & Wagner), a near-linear approximation
of ALiBi attention by random contiguous block masks."""
from .alibi import alibi_bias, alibi_matrix, alibi_sigmas, alibi_slopes
from .attention import attend, available_backends, poslsh_attention, poslsh_attention_2d
from . import window
from .window import AlibiWindow, make_window, windowed_alibi_attention
from . import alibi as _alibi, attention as _attention
from ._compat import moved_names as _moved_names
from .documents import Documents
from .merge import merge_attention
from .partitions import Blocks, Partitions, sample_partitions
from .reference import alibi_attention, poslsh_attention_reference
from . import cost, theory
from .modules import PartitionSchedule, PoslshAttention
# N dimensions (paper section 5): 2-D ALiBi over image patches, other positional kernels
from .widths import FixedWidth, GammaWidths
from .partitions_nd import PartitionsND, expected_mask, grid_coords, sample_partitions_nd
from .reference import alibi_attention_nd, alibi_bias_nd, alibi_matrix_nd, kernel_attention_nd, \
    poslsh_attention_reference_nd

__version__ = "0.2.0"

__all__ = [
    "alibi_slopes", "alibi_sigmas", "alibi_bias", "alibi_matrix", "AlibiWindow", "make_window",
    "Partitions", "Blocks", "sample_partitions",
    "alibi_attention", "poslsh_attention_reference", "attend", "poslsh_attention", "windowed_alibi_attention",
    "available_backends", "merge_attention", "Documents",
    "theory", "cost", "PartitionSchedule", "PoslshAttention",
    "PartitionsND", "sample_partitions_nd", "grid_coords", "expected_mask", "GammaWidths", "FixedWidth",
    "alibi_bias_nd", "alibi_matrix_nd", "alibi_attention_nd", "kernel_attention_nd", "poslsh_attention_reference_nd",
    "poslsh_attention_2d",
]

# Names that moved keep working for one release (with one warning each).
_moved_names(vars(_alibi), {"AlibiWindow": (lambda: AlibiWindow, "poslsh.AlibiWindow (poslsh.window.AlibiWindow)"),
                            "make_window": (lambda: make_window, "poslsh.window.make_window")})
_moved_names(vars(cost), {name: ((lambda name=name: getattr(window, name)), f"poslsh.window.{name}")
                          for name in ("cost_matched_window", "window_keys_per_query")})
_moved_names(vars(_attention), {"windowed_alibi_attention": (lambda: windowed_alibi_attention,
                                                             "poslsh.windowed_alibi_attention (poslsh.window)")})

# Register every backend now, not at the first call: a first call inside torch.compile would
# otherwise import modules while dynamo traces (a graph break, an error under fullgraph=True).
from .ops import load_backends as _load_backends  # noqa: E402

_load_backends()
