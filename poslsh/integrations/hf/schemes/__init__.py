"""RoPE models (Llama / Qwen3 / Mistral families) given a positional scheme: the one attention function of the
schemes and the conversion.

* :mod:`.attention`: :func:`~.attention.attention_forward`, the attention of every scheme (they differ in
  :data:`~.attention.SCHEME_RULES` and their positional object), its registration, the entry points;
* :mod:`.convert`: :class:`~.convert.PositionalConfig` (saved as ``config.poslsh``), RoPE removal;
* :mod:`.state`: what one attention layer keeps between calls (its positional object).
"""
