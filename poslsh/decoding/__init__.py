"""Streaming decoding with bounded KV caches (``docs/decoding.md``).

* :mod:`.stream`: the eviction rule of every sequence kind (:func:`first_needed`, :func:`cache_bound`,
  eq. (4)'s :func:`cache_bound_whp`), :class:`KVWindow` (one layer, one stream), packed prefills;
* :mod:`.heads`: :class:`HeadWindows`, the per-head window store (each KV head keeps its own window),
  with :mod:`.rows` (left padding, positions) and :mod:`.sinks` (the first positions kept exactly);
* :mod:`.certificate`: :class:`Certificate`, the per-step bound on the mass a window drops.
"""
from .certificate import POLICIES, Certificate, CertificateWarning, certified_window
from .heads import HeadWindows, head_buckets
from .stream import (PER_HEAD_STORES, SEQUENCE_KINDS, KVWindow, Positional, attend, cache_bound, cache_bound_whp,
                     check_positional, document_rows, first_needed, packed_windows, reach, span_backend)

__all__ = ["Positional", "check_positional", "attend", "reach", "first_needed", "cache_bound", "cache_bound_whp",
           "span_backend", "KVWindow", "document_rows", "packed_windows", "HeadWindows", "head_buckets",
           "Certificate", "CertificateWarning", "POLICIES", "certified_window"]
