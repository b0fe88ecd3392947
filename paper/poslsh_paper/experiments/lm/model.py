"""The model a run trains and the process it runs in.

:func:`build_model` turns ``cfg.method`` into a Hugging Face causal LM with that
positional scheme (a Qwen3-style model from scratch, or a pretrained model with
LoRA); :class:`Dist` holds the process-group facts (a single process is world
size 1); :func:`load_data` reads the token streams, rank 0 first.
"""
from __future__ import annotations

import os
import warnings
from contextlib import nullcontext
from typing import List, Tuple

import torch

from poslsh_paper.data.tokens import TokenData, load_token_data
from poslsh_paper.experiments.command import ConfigError
from poslsh_paper.experiments.lm.config import TrainConfig, parse_method

__all__ = ["Dist", "load_data", "positional_config", "build_model", "unwrap", "trainable_parameters",
           "autocast_for"]


class Dist:
    """Process-group facts from the ``torchrun`` environment; DDP uses gloo on CPU, NCCL on GPU."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        self.device = torch.device(f"cuda:{local}" if use_cuda else "cpu")
        if use_cuda:
            torch.cuda.set_device(self.device)
        if self.world > 1 and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if use_cuda else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def sum(self, values) -> list:
        """``values`` summed over ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return t.tolist()


def load_data(cfg: TrainConfig, dist: Dist) -> TokenData:
    """Token streams of ``cfg.data``; rank 0 builds the cache first, the other ranks then read it."""
    cache = cfg.cache_dir or None
    if dist.main:
        data = load_token_data(cfg.data, cache)
    dist.barrier()
    if not dist.main:
        data = load_token_data(cfg.data, cache)
    return data


def _scheme_params(cfg: TrainConfig) -> dict:
    """The :class:`poslsh.integrations.hf.PositionalConfig` fields of ``cfg.method`` (the window
    fields only for the alibi-window scheme, which alone takes them)."""
    m = parse_method(cfg.method)
    params = dict(num_samples=m.num_samples, sampler=m.sampler, group_size=m.group_size,
                  block_size=cfg.fixed_block_size, seed=cfg.seed, eval_seed=cfg.seed)
    if m.scheme == "alibi-window":
        params.update(window_sigmas=m.window_sigmas, window_cost_samples=m.window_cost_samples)
    return params


def positional_config(cfg: TrainConfig):
    """The :class:`poslsh.integrations.hf.PositionalConfig` of ``cfg.method``: partitions
    seeded by the run's seed, in training (with the step) and in evaluation; the alibi-window
    methods' per-head window (``c sigma_h`` or cost-matched, the same at every length)."""
    from poslsh.integrations import hf

    return hf.PositionalConfig(scheme=parse_method(cfg.method).scheme, **_scheme_params(cfg))


def build_model(cfg: TrainConfig, vocab_size: int, separator_id: int = 0):
    """The model of ``cfg.method``: a Qwen3-style model from scratch or a LoRA-wrapped
    pretrained model, with the method's positional scheme (RoPE removed unless original)."""
    from poslsh.integrations import hf

    if cfg.model.kind == "bloom":     # transformers' BLOOM, its own ALiBi (or patch_alibi): poslsh_paper.experiments.lm.bloom
        from poslsh_paper.experiments.lm.bloom import build_bloom
        return build_bloom(cfg, vocab_size, separator_id)
    pc = positional_config(cfg)
    params = _scheme_params(cfg)
    torch.manual_seed(cfg.seed)   # initial weights (scratch) / LoRA init depend on the seed only
    m = cfg.model
    if m.kind == "scratch":
        from transformers import Qwen3Config
        qcfg = Qwen3Config(vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                           num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                           num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
                           max_position_embeddings=cfg.seq_len * max(cfg.eval_multipliers),
                           tie_word_embeddings=True, attention_dropout=0.0, bos_token_id=separator_id,
                           eos_token_id=separator_id, pad_token_id=separator_id)
        return hf.model_from_config(qcfg, pc.scheme, **params)
    if m.kind != "lora":
        raise ConfigError(f"model.kind must be 'scratch', 'lora' or 'bloom', got {m.kind!r}")
    from peft import LoraConfig, get_peft_model
    if m.base == "smollm2":
        from poslsh_paper.models.smollm2 import load_smollm2
        model, _ = load_smollm2()
    else:   # a local directory saved with save_pretrained; nothing is downloaded
        from transformers import AutoModelForCausalLM

        from poslsh_paper.models.smollm2 import quiet_loading
        with quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(m.base, local_files_only=True, dtype=torch.float32)
    if model.config.vocab_size < vocab_size:
        raise ConfigError(f"data.tokenizer has {vocab_size} tokens but the model only {model.config.vocab_size}: "
                          "use the model's own tokenizer")
    hf.apply_positional_scheme(model, pc.scheme, **params)
    torch.manual_seed(cfg.seed)
    lora = LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout, bias="none",
                      target_modules=list(m.lora_targets), task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # peft asks transformers 5 for `is_gradient_checkpointing`, which warns that it is renamed:
        # a notice to peft, not to the user, printed between our own lines. Only that one is silenced.
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, lora)


def unwrap(model):
    """The model inside a ``DistributedDataParallel`` wrapper."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def trainable_parameters(model) -> List[Tuple[str, torch.nn.Parameter]]:
    """``[(name, parameter)]`` of what is trained and checkpointed (LoRA: the adapters only)."""
    return [(n, p) for n, p in unwrap(model).named_parameters() if p.requires_grad]


def autocast_for(cfg: TrainConfig, device: torch.device):
    """bf16 autocast on CUDA (unless ``amp="off"``); float32 on CPU."""
    if device.type == "cuda" and cfg.amp in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()
