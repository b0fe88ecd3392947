"""The Triton kernels, built from shared pieces (docs/triton.md, "The kernels"):

* :mod:`.common`: reductions, loads and stores, the program's tile (``program_tile``), the streamed
  matrices (``rows_of``), the online-softmax step, the backward's recomputed weights, the
  forward's row statistics, and the backward's ``delta`` kernel (both ops);
* :mod:`.counts`: positional LSH's count (the plan's blocks of a tile, the one-hot and
  label-compare methods, one dispatcher ``count_tile``);
* :mod:`.plan`: the plan kernel;
* :mod:`.sequence_fwd`, :mod:`.sequence_bwd`: positional LSH (the ``"sequence"`` op);
* :mod:`.window_fwd`, :mod:`.window_bwd`: exact ALiBi cut at per-head windows (the ``"window"`` op).

Triton decides between interpreter and compiler when a function is decorated, so
:func:`.._launch.kernels` executes this package once per mode under its own name (the relative
imports below then load that mode's copy of every module); nothing imports it otherwise.
"""
from .common import _bwd_pre_kernel  # noqa: F401
from .counts import _tile_blocks_kernel  # noqa: F401
from .plan import _plan_kernel  # noqa: F401
from .sequence_bwd import _bwd_dkdv_kernel, _bwd_dq_kernel  # noqa: F401
from .sequence_fwd import _fwd_kernel  # noqa: F401
from .window_bwd import _win_dkdv_kernel, _win_dq_kernel  # noqa: F401
from .window_fwd import _win_fwd_kernel  # noqa: F401
