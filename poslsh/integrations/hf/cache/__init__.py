"""The bounded KV cache in transformers' cache API (:class:`PoslshCache`), for both families of models.

* :mod:`.poslsh_cache`: :class:`PoslshCache`, the shared-window layer, the scheme step :func:`attend`,
  :func:`packed_prefill_cache`, :func:`generation_cache` and the ``generate()`` hook;
* :mod:`.heads`: :class:`HeadWindowLayer`, each KV head its own ALiBi window (also the entry point of
  attentions that call the cache themselves: the patched ALiBi models);
* :mod:`.spec`: what a cache is keyed on (:class:`CacheSpec`) and the check that the attention calling a layer
  is the one it was built for.
"""
from .heads import HeadWindowLayer
from .poslsh_cache import (BLOCK_SCHEMES, CACHE_KWARG, CACHE_SCHEMES, WINDOW_SCHEMES, Certificate, PoslshCache,
                           PoslshCacheLayer, attend, enable_generation_cache, generation_cache, left_pads,
                           packed_prefill_cache, span_rows_attention)
from .spec import CacheSpec

__all__ = ["CACHE_KWARG", "BLOCK_SCHEMES", "WINDOW_SCHEMES", "CACHE_SCHEMES", "CacheSpec", "PoslshCacheLayer",
           "HeadWindowLayer", "PoslshCache", "Certificate", "attend", "span_rows_attention", "left_pads",
           "packed_prefill_cache", "generation_cache", "enable_generation_cache"]
