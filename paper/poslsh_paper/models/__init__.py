"""Pretrained models loaded offline (no download at run time)."""
from poslsh_paper.models.smollm2 import (GGUF_FILENAME, ModelNotAvailable, default_cache_dir, load_causal_lm, load_smollm2,
                      load_smollm2_tokenizer, smollm2_available, smollm2_gguf_path)

__all__ = ["GGUF_FILENAME", "ModelNotAvailable", "default_cache_dir", "load_causal_lm", "load_smollm2",
           "load_smollm2_tokenizer", "smollm2_available", "smollm2_gguf_path"]
