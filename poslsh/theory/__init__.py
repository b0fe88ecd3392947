"""The paper's guarantees as functions, the exact norms they bound, and the window's bound.

* :mod:`.bounds`: Theorem 2.1 and eqs. (1)-(4) on the mask ``L* - M~`` (spectral, max norm, correlated
  samplers, block size, runtime);
* :mod:`.norms`: the exact norms of ``L* - M~`` (no ``O(s n^2)`` work);
* :mod:`.output`: Theorem 2.2, the output error from an instance's ``beta*_P`` and ``||P||_{2,inf}``;
* :mod:`.nd`: any positional LSH (section 5: N-D ALiBi, other kernels);
* :mod:`.window`: exact ALiBi cut at a window, its attainable bound and inverse (defined in the
  window's room, :mod:`poslsh.window.theory`).

One argument order for every function here: what the bound is about first (an ``eps``, a statistic
of the instance, a window or a tolerance), then ``n`` (and ``d``), ``num_samples``, ``sigma``, ``delta``, ``C``. The rate is the bandwidth
``sigma_h = 1 / m_h`` everywhere here (:func:`poslsh.alibi_sigmas`; from slopes, ``1 / slopes``).
"""
from .bounds import (alibi_norm_bound, block_size_bound, grouped_max_norm_deviation_bound,
                     grouped_max_norm_tail_probability, max_norm_bound_for, max_norm_deviation_bound,
                     max_norm_tail_probability, psi, runtime_bound, samples_for_max_norm, spectral_deviation_bound,
                     spectral_expectation_bound, spectral_tail_probability)
from .nd import (delta_p_prime, dense_mask_errors, general_output_error_bound, kernel_instance_stats,
                 realized_output_error_bound)
from .norms import MaskErrors, mask_error_matvec, mask_error_norms, max_norm_error, spectral_norm_error
from .output import InstanceStats, delta_p, instance_stats, output_error_bound, smallest_constant
from .window import logit_range, logit_range_bound, smallest_window, window_error_bound, window_tail_ratio

__all__ = [
    "psi", "alibi_norm_bound", "spectral_expectation_bound", "spectral_tail_probability",
    "spectral_deviation_bound", "max_norm_tail_probability", "max_norm_deviation_bound",
    "samples_for_max_norm", "grouped_max_norm_tail_probability", "grouped_max_norm_deviation_bound",
    "max_norm_bound_for", "block_size_bound", "runtime_bound", "MaskErrors", "mask_error_norms",
    "max_norm_error", "spectral_norm_error", "mask_error_matvec", "InstanceStats", "instance_stats",
    "delta_p", "output_error_bound", "smallest_constant",
    # any positional LSH (paper section 5): N-D ALiBi, other kernels
    "dense_mask_errors", "kernel_instance_stats", "delta_p_prime", "general_output_error_bound",
    "realized_output_error_bound",
    # exact ALiBi cut at a window (poslsh.window.theory)
    "window_tail_ratio", "window_error_bound", "smallest_window", "logit_range", "logit_range_bound",
]
