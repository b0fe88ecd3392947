"""Measurement library: what the experiments measure, without jobs, flags or files.

This room owns

* :mod:`~poslsh_paper.analysis.qkv`: a pretrained model's own queries, keys and values
  per layer and head (forward hooks), and the input segments they are captured on;
* :mod:`~poslsh_paper.analysis.mask_counts`: count matrices of nested partition
  samples, the norms of ``L* - M~`` and the exact / approximate attention outputs
  computed from them;
* :mod:`~poslsh_paper.analysis.records`: the error records of one partition draw
  (mask norms, attention-output errors, instance statistics) and the library
  cross-check.

Floor: imports core (``alibi, partitions, theory, reference``), op (``attention``),
``data`` and ``models``; never ``experiments``, ``integrations`` or ``cli``.
"""
from poslsh_paper.analysis.mask_counts import (CountSnapshot, ExactOutput, approx_output, causal_weights, dense_from_band,
                          exact_output, mask_max_error, mask_spectral_error, nested_counts)
from poslsh_paper.analysis.qkv import (LayerQKV, RealQKV, Segment, attention_geometry, capture_qkv, corpus_segments, decoder_layers,
                  random_segments, real_qkv_or_none)
from poslsh_paper.analysis.records import (FIT_MIN_S, ROW_FIELDS, cross_check, default_heads, equivalent_samples, fit_slope,
                      input_records, mask_records, sampler_draws)

__all__ = [
    # qkv
    "LayerQKV", "RealQKV", "Segment", "attention_geometry", "capture_qkv", "corpus_segments", "decoder_layers",
    "random_segments", "real_qkv_or_none",
    # mask counts
    "CountSnapshot", "ExactOutput", "approx_output", "causal_weights", "dense_from_band", "exact_output",
    "mask_max_error", "mask_spectral_error", "nested_counts",
    # records
    "FIT_MIN_S", "ROW_FIELDS", "cross_check", "default_heads", "fit_slope", "input_records", "mask_records",
    "sampler_draws", "equivalent_samples",
]
