"""poslsh: positional-LSH attention (Wolfson & Wagner), a near-linear approximation
of ALiBi attention by random contiguous block masks."""
from .alibi import alibi_bias, alibi_matrix, alibi_sigmas, alibi_slopes
from .attention import available_backends, poslsh_attention
from .partitions import Blocks, Partitions, sample_partitions
from .reference import alibi_attention, poslsh_attention_reference
from . import theory

__version__ = "0.1.0"

__all__ = [
    "alibi_slopes", "alibi_sigmas", "alibi_bias", "alibi_matrix",
    "Partitions", "Blocks", "sample_partitions",
    "alibi_attention", "poslsh_attention_reference", "poslsh_attention", "available_backends",
    "theory",
]
