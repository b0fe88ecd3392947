"""RoPE models (Llama / Qwen3 / Mistral families) given a positional scheme, registered with transformers.

* :mod:`.attention`: :func:`~.attention.attention_forward`, the one attention function of every scheme (the
  schemes differ in their rules, :data:`~poslsh.integrations.hf.config.SCHEME_RULES`, and their positional
  object) and its registration;
* :mod:`.apply`: the entry points (:func:`~.apply.apply_positional_scheme`, :func:`~.apply.model_from_config`,
  :func:`~.apply.from_pretrained`);
* :mod:`.convert`: RoPE removal and the saved scheme (:func:`~.convert.convert`);
* :mod:`.state`: what one attention layer keeps between calls (its positional object).

The scheme itself, :class:`~poslsh.integrations.hf.config.PositionalConfig`, sits one floor down (the cache
keys on it too).
"""
from .apply import apply_positional_scheme, from_pretrained, model_from_config
from .attention import (CONTEXT_KWARG, STEP_KWARG, alibi_attention_forward, alibi_window_attention_forward,
                        attention_forward, fixed_blocks_attention_forward, poslsh_attention_forward, register)
from .convert import NO_ROTATION, NoRotaryEmbedding, attention_modules, convert
from .state import LayerState, layer_partitions, layer_positional, layer_state, layer_window

__all__ = ["apply_positional_scheme", "from_pretrained", "model_from_config", "attention_forward",
           "poslsh_attention_forward", "fixed_blocks_attention_forward", "alibi_attention_forward",
           "alibi_window_attention_forward", "register", "STEP_KWARG", "CONTEXT_KWARG", "NO_ROTATION",
           "NoRotaryEmbedding", "attention_modules", "convert", "LayerState", "layer_partitions", "layer_positional",
           "layer_state", "layer_window"]
