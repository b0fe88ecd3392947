"""The bounded KV cache in transformers' cache API (:class:`PoslshCache`), for both families of models.

* :mod:`.poslsh_cache`: :class:`PoslshCache` (one layer per decoder layer), the scheme step :func:`attend`,
  :func:`packed_prefill_cache`, :func:`generation_cache` and the ``generate()`` hook;
* :mod:`.layer`: :class:`PoslshCacheLayer`, one tensor evicted to the widest head's window (positional LSH);
* :mod:`.heads`: :class:`HeadWindowLayer`, each KV head its own ALiBi window (also the entry point of
  attentions that call the cache themselves: the patched ALiBi models);
* :mod:`.append`: :class:`AppendCache`, every key appended in place (exact decoding without transformers'
  per-step concatenation);
* :mod:`.spec`: what a cache is keyed on (:class:`CacheSpec`) and the check that the attention calling a layer
  is the one it was built for.
"""
from .append import AppendCache, AppendLayer
from .heads import HeadWindowLayer
from .layer import PoslshCacheLayer
from .poslsh_cache import PoslshCache, attend, enable_generation_cache, generation_cache, packed_prefill_cache
from .spec import CACHE_KWARG, CACHE_SCHEMES, FULL_SCHEMES, NEW_CACHE, WINDOW_SCHEMES, CacheSpec, check_layer

__all__ = ["PoslshCache", "PoslshCacheLayer", "HeadWindowLayer", "AppendCache", "AppendLayer", "CacheSpec", "attend",
           "packed_prefill_cache", "generation_cache", "enable_generation_cache", "CACHE_KWARG", "CACHE_SCHEMES",
           "FULL_SCHEMES", "WINDOW_SCHEMES", "NEW_CACHE", "check_layer"]
