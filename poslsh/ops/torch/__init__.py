"""The ``"torch"`` backend: portable near-linear attention in plain PyTorch (CPU and CUDA), the
counterpart of :mod:`poslsh.ops.triton` (``docs/architecture.md`` draws both).

* :mod:`.ops`: the ``"sequence"`` and ``"window"`` ops as ``torch.library`` custom-op pairs, batch
  rows grouped by packing, the busy-CPU thread policy; registers the backend of both ops;
* :mod:`.plan`: the row bounds of every op (each query row's keys, :class:`~.plan.Layout` for packed
  documents); :mod:`.tiles`: the tile plan and the one chunk bias; :mod:`.kernels`: the tiled forward,
  flash-attention 2's backward and the few-queries forward;
* :mod:`.band`: the window op's band kernels (no packed documents); :mod:`.workers`: the chunks of a
  call on threads;
* :mod:`.grid`: the ``"nd"`` op over a 2-D token grid (registers its backend).

Importing a module registers what it serves; :func:`poslsh.ops.load_backends` imports :mod:`.ops` and
:mod:`.grid`.
"""
