"""transformers' own ``BloomForCausalLM`` as a run's model (``--model.kind bloom``): BLOOM's ALiBi, trained eagerly.

The model is built from scratch at the width of the scratch model (hidden ``hidden_size``,
``num_layers`` blocks of ``num_heads`` heads; BLOOM has no GQA, its MLP is 4 x the width). It trains
as transformers wrote it (``--method original``: the unmodified eager attention, BLOOM's own ALiBi),
and the trained weights are then evaluated, unchanged, through
:func:`poslsh.integrations.hf.patch_alibi` by naming another method:

* ``alibi``: exact ALiBi over every key (``patch_alibi(model)``), never an n x n tensor;
* ``alibi-tol1e-<k>``: the certified per-head window at tolerance ``10^-k`` (``window="certified"``);
* ``alibi-wcost<s>``: the window whose keys per query are positional LSH's at ``s`` samples
  (:func:`poslsh.cost.cost_matched_window` of BLOOM's slopes);
* ``alibi-w<c>``: the window ``ceil(c sigma_h)`` (:func:`poslsh.window.windows_in_sigmas`);
* ``poslsh-s<k>``: positional LSH with ``k`` i.i.d. partitions per head (``num_samples=k``, seeded by the run).

The unpatched eager model materialises ``[batch x heads, n, n]`` float32 scores; an evaluation
length whose scores would pass :data:`EAGER_LIMIT_GIB` is skipped and says so (:func:`eager_gib`).
"""
from __future__ import annotations

import math

import torch

from poslsh_paper.experiments.command import ConfigError
from poslsh_paper.experiments.lm.methods import parse_method

__all__ = ["BLOOM_METHODS", "EAGER_LIMIT_GIB", "build_bloom", "bloom_slopes", "bloom_window", "patch_for_method",
           "eager_gib", "eager_skip"]

# What a BLOOM run evaluates its trained weights as (the first trains; the others are evaluations).
BLOOM_METHODS = ("original", "alibi", "alibi-tol1e-3", "alibi-wcost10", "poslsh-s10")
EAGER_LIMIT_GIB = 8.0
# The eager forward holds about this many [B H, n, n] float32 tensors at once (baddbmm scores,
# their masked copy, the softmax), measured on transformers 5.24's BloomAttention.
_EAGER_COPIES = 3


def check_bloom(cfg) -> None:
    """Methods a BLOOM run can be (one line naming the method otherwise)."""
    p = parse_method(cfg.method)
    if p.scheme in ("original", "alibi", "alibi-window") or (p.scheme == "poslsh" and p.sampler == "iid"):
        return
    raise ConfigError(f"method: {cfg.method} is not a way to run BLOOM's attention; with model.kind bloom use "
                      "original (transformers' eager attention, what the run trains), alibi (exact, patch_alibi), "
                      "alibi-tol1e-<k> (certified window), alibi-wcost<s> or alibi-w<c> (windows) or poslsh-s<k>")


def build_bloom(cfg, vocab_size: int, separator_id: int = 0):
    """A random-init ``BloomForCausalLM`` of ``cfg.model``'s width (seeded by ``cfg.seed``), its
    attention as ``cfg.method`` says (:func:`patch_for_method`)."""
    from transformers import BloomConfig, BloomForCausalLM

    check_bloom(cfg)
    m = cfg.model
    bcfg = BloomConfig(vocab_size=vocab_size, hidden_size=m.hidden_size, n_layer=m.num_layers, n_head=m.num_heads,
                       hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=separator_id,
                       eos_token_id=separator_id, pad_token_id=separator_id, tie_word_embeddings=True)
    torch.manual_seed(cfg.seed)
    model = BloomForCausalLM(bcfg)
    return patch_for_method(model, cfg)


def bloom_slopes(num_heads: int) -> torch.Tensor:
    """BLOOM's ALiBi slopes ``[H]`` (float64) as its own code computes them (the non-power-of-2 rule)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float64)   # [H, 1, 2]: slope x (0, 1)
    return alibi[:, 0, 1].clone()


def bloom_window(cfg):
    """The per-head window (int64 ``[H]``) of an ``alibi-w<c>`` / ``alibi-wcost<s>`` method."""
    from poslsh.cost import cost_matched_window
    from poslsh.window import windows_in_sigmas

    p = parse_method(cfg.method)
    sigma = 1.0 / bloom_slopes(cfg.model.num_heads)      # the model's slopes as bandwidths
    if p.window_cost_samples is not None:
        return cost_matched_window(sigma, p.window_cost_samples)
    return windows_in_sigmas(p.window_sigmas, sigma)


def patch_for_method(model, cfg):
    """``model`` (a BLOOM) with its attention as ``cfg.method``: unchanged (original) or through
    ``patch_alibi`` (every other method, see the module docstring)."""
    p = parse_method(cfg.method)
    if p.scheme == "original":
        return model
    from poslsh.integrations.hf import patch_alibi

    if p.scheme == "alibi":
        return patch_alibi(model)
    if p.scheme == "poslsh":
        return patch_alibi(model, num_samples=p.num_samples, seed=cfg.seed)
    if p.window_tol is not None:
        return patch_alibi(model, window="certified", tol=p.window_tol)
    return patch_alibi(model, window=bloom_window(cfg).tolist())


def eager_gib(cfg, batch: int, context: int) -> float:
    """GiB the unpatched eager BLOOM holds in one layer's attention scores for ``batch`` windows of
    ``context`` tokens (float32 ``[batch x heads, context, context]``, :data:`_EAGER_COPIES` at once)."""
    return _EAGER_COPIES * batch * cfg.model.num_heads * context * context * 4 / 2**30


def eager_skip(cfg, batch: int, context: int):
    """Why the eager model skips this length (a sentence), or None when it fits in :data:`EAGER_LIMIT_GIB`."""
    if cfg.model.kind != "bloom" or parse_method(cfg.method).scheme != "original":
        return None
    need = eager_gib(cfg, batch, context)
    if need <= EAGER_LIMIT_GIB:
        return None
    return (f"not run: transformers' eager attention would hold about {need:.0f} GiB of n x n scores per layer at "
            f"context {context} (batch {batch}), over the {EAGER_LIMIT_GIB:g} GiB limit")
