"""Unmodified transformers BLOOM, MPT and Falcon (``alibi=True``) on the library's ops: :func:`patch_alibi`.

* :mod:`.patch`: :func:`patch_alibi`, :func:`alibi_stats`, the hooks and refusals;
* :mod:`.families`: one module per model family (its attention class, slopes, refusals and patched forward);
  a new ALiBi family is a module there and one entry in its ``FAMILIES``;
* :mod:`.layer`: one patched layer's state (:class:`~.layer.LayerAlibi`: its positional object, certified
  windows) and its attention;
* :mod:`.attend`: every query row the model's own, one op call per group of rows, exact dropout;
* :mod:`.call`: the padding mask and packed documents of the call, from the base model's own arguments;
* :mod:`.cache`: :func:`alibi_cache`, decoding on per-head windows (a
  :class:`~poslsh.integrations.hf.cache.PoslshCache`).
"""
from .cache import alibi_cache
from .patch import alibi_stats, patch_alibi

__all__ = ["patch_alibi", "alibi_stats", "alibi_cache"]
