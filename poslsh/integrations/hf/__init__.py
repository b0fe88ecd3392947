"""Hugging Face ``transformers`` integration, without forking transformers.

Two families of models, each a sub-package, on shared pieces below them:

* :mod:`.schemes`: RoPE models (Llama / Qwen3 / Mistral families) given a positional scheme. Importing this
  package registers four attention implementations with ``transformers.AttentionInterface`` (and a mask builder
  with ``AttentionMaskInterface``, so padding masks reach them) and the rope type ``"poslsh_no_rotation"``:
  ``"poslsh"`` (positional LSH), ``"fixed_blocks"`` (the paper's baseline), ``"alibi"`` (exact ALiBi, dense like
  stock ``sdpa``) and ``"alibi-window"`` (exact ALiBi cut at a per-head window). :func:`apply_positional_scheme`
  turns a model (or config) into one whose *only* positional signal is the scheme (RoPE removed); a model saved
  after that reloads as itself with plain ``AutoModelForCausalLM.from_pretrained`` once poslsh is imported.
* :mod:`.alibi`: unmodified BLOOM, MPT and Falcon (``alibi=True``) on the library's ops (:func:`patch_alibi`),
  one module per model family under :mod:`.alibi.families`.
* :mod:`.encoders`: the ALiBi encoders (MosaicBERT, DNABERT-2, Jina-BERT-v2) loaded natively from their
  checkpoints (:func:`load_alibi_encoder`), no remote code; they need no transformers class.

Below them, what both families use: :mod:`.cache` (:class:`PoslshCache`, the bounded KV cache of
``generate()``; :class:`AppendCache`, every key appended in place), and the shared pieces :mod:`.rows` (batch
rows at their own positions, one op call per group of rows), :mod:`.masks` (padding and packed documents) and
:mod:`.config` (:class:`PositionalConfig`, the scheme a converted model saves; the cache keys on it). Every import points down
(``hf -> schemes | alibi | encoders -> cache -> rows, masks, config``; ``tests/test_architecture.py``), and the families never
import each other: a new family of models is a sibling sub-package.

Importing any module of this package first checks the installed transformers (one line naming what to install)
and registers the implementations.
"""
from __future__ import annotations

from .. import require_transformers

require_transformers()      # one line naming what to install, before the imports that need it

from .alibi import alibi_cache, alibi_stats, patch_alibi  # noqa: E402
from .cache import AppendCache, PoslshCache, enable_generation_cache, generation_cache  # noqa: E402
from .config import IMPLEMENTATIONS, SCHEME_RULES, SCHEMES, PositionalConfig, positional_config  # noqa: E402
from .encoders import load_alibi_encoder, pool_embeddings  # noqa: E402
from .schemes import (CONTEXT_KWARG, NO_ROTATION, STEP_KWARG, LayerState, NoRotaryEmbedding,  # noqa: E402
                      alibi_attention_forward, alibi_window_attention_forward, apply_positional_scheme,
                      attention_forward, fixed_blocks_attention_forward, from_pretrained, layer_partitions,
                      layer_positional, layer_state, layer_window, model_from_config, poslsh_attention_forward,
                      register)

__all__ = ["SCHEMES", "IMPLEMENTATIONS", "NO_ROTATION", "PositionalConfig", "register", "apply_positional_scheme",
           "model_from_config", "from_pretrained", "positional_config", "layer_partitions", "layer_window",
           "LayerState", "layer_state", "NoRotaryEmbedding", "poslsh_attention_forward", "alibi_attention_forward",
           "fixed_blocks_attention_forward", "alibi_window_attention_forward", "attention_forward", "SCHEME_RULES",
           "layer_positional", "PoslshCache", "AppendCache", "generation_cache",
           "enable_generation_cache", "STEP_KWARG", "CONTEXT_KWARG", "patch_alibi", "alibi_stats", "alibi_cache",
           "load_alibi_encoder", "pool_embeddings"]

register()       # the implementations and the rope type, on import (idempotent)
