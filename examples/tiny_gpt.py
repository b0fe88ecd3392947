"""A decoder-only language model on ``poslsh.PoslshAttention`` or ``poslsh.AlibiAttention``, in one
sitting (nanoGPT size).

Character-level, pre-norm blocks, no positional embedding at all: the attention's ALiBi bias is the
model's only sense of order, estimated by positional LSH (``--attention poslsh``, the default) or exact
inside a window of ``window_sigmas`` bandwidths per head (``--attention alibi-window``), so it runs at
lengths it was never trained on. Train it on any text file, on the CPU::

    python examples/tiny_gpt.py --preset tiny --steps 300 --text /usr/share/doc/python3.11/html/library/functions.html

(any UTF-8 text works, gzipped too, as Debian ships most of ``/usr/share/doc``; the package
``python3.11-doc`` has plenty). ``--preset nano`` is
nanoGPT's "baby" size (6 layers, 6 heads, 384 wide). Partitions: fresh per (seed, step, layer) in
training, fixed per layer in evaluation (:class:`poslsh.PartitionSchedule`).
"""
from __future__ import annotations

import argparse
import gzip
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import poslsh


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256          # bytes
    block_size: int = 128          # training length
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2             # GQA
    n_embd: int = 64
    attention: str = "poslsh"      # "poslsh" (PoslshAttention) or "alibi-window" (AlibiAttention)
    num_samples: int = 10          # positional LSH: partitions per head
    sampler: str = "iid"
    window_sigmas: float = 4.0     # the window: w_h = ceil(window_sigmas * sigma_h)
    seed: int = 0


PRESETS: Dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "nano": GPTConfig(block_size=256, n_layer=6, n_head=6, n_kv_head=6, n_embd=384),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        if cfg.attention == "alibi-window":
            self.attn = poslsh.AlibiAttention(cfg.n_embd, cfg.n_head, num_kv_heads=cfg.n_kv_head,
                                              window_sigmas=cfg.window_sigmas, causal=True)
        elif cfg.attention == "poslsh":
            self.attn = poslsh.PoslshAttention(cfg.n_embd, cfg.n_head, num_kv_heads=cfg.n_kv_head,
                                               num_samples=cfg.num_samples, sampler=cfg.sampler, causal=True,
                                               layer=layer, seed=cfg.seed)
        else:
            raise ValueError(f"attention must be 'poslsh' or 'alibi-window', got {cfg.attention!r}")
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: Tensor, step: Optional[int]) -> Tensor:
        x = x + self.attn(self.ln1(x), step=step)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``ids [B, n]`` (any ``n``) -> ``logits [B, n, vocab]``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight          # weight tying

    def forward(self, ids: Tensor, step: Optional[int] = None) -> Tensor:
        x = self.wte(ids)
        for blk in self.blocks:
            x = blk(x, step)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, ids: Tensor, new_tokens: int) -> Tensor:
        """Greedy continuation (recomputes the whole prefix each step: a demo, not a server;
        see ``docs/decoding.md`` for the bounded KV cache)."""
        for _ in range(new_tokens):
            ids = torch.cat([ids, self(ids)[:, -1:].argmax(-1)], 1)
        return ids


def batches(data: Tensor, cfg: GPTConfig, batch: int, generator: torch.Generator):
    """Random windows of ``block_size + 1`` bytes: inputs and next-byte targets."""
    while True:
        i = torch.randint(0, data.numel() - cfg.block_size - 1, (batch,), generator=generator)
        x = torch.stack([data[j:j + cfg.block_size + 1] for j in i.tolist()])
        yield x[:, :-1], x[:, 1:]


def train(cfg: GPTConfig, data: Tensor, *, steps: int, batch: int = 8, lr: float = 3e-3, log_every: int = 50):
    """Train from scratch; returns the model and the list of training losses."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    t0 = time.perf_counter()
    for step, (x, y) in zip(range(steps), batches(data, cfg, batch, torch.Generator().manual_seed(cfg.seed))):
        loss = F.cross_entropy(model(x, step=step).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:5d}  loss {loss.item():.3f}  ({time.perf_counter() - t0:.0f} s)")
    return model, losses


@torch.no_grad()
def evaluate(model: GPT, data: Tensor, length: int, windows: int = 8) -> float:
    """Mean next-byte loss over ``windows`` evenly spaced windows of ``length`` bytes (eval partitions)."""
    model.eval()
    starts = torch.linspace(0, data.numel() - length - 1, windows).long().tolist()
    x = torch.stack([data[s:s + length + 1] for s in starts])
    loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    model.train()
    return float(loss)


def read_text(path: Path) -> bytes:
    """The bytes of a text file, decompressed when it is gzipped (``*.gz``, or gzip's magic bytes)."""
    raw = path.read_bytes()
    return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--text", type=Path, help="a UTF-8 text file, or a gzipped one (default: this file)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--samples", type=int, help="positional LSH samples per head (default: the preset's)")
    ap.add_argument("--attention", choices=("poslsh", "alibi-window"), default="poslsh")
    return ap


def main(argv=None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    cfg = replace(PRESETS[args.preset], attention=args.attention)
    if args.samples:
        cfg = replace(cfg, num_samples=args.samples)
    if args.text is not None and not args.text.is_file():
        ap.error(f"--text: {args.text} is not a file (e.g. sudo apt-get install python3.11-doc for the command "
                 "in this file's docstring, or any UTF-8 text file)")
    text = read_text(args.text or Path(__file__))
    data = torch.tensor(list(text), dtype=torch.long)
    cut = int(0.9 * data.numel())
    model, _ = train(cfg, data[:cut], steps=args.steps)
    for length in (cfg.block_size, 2 * cfg.block_size, 4 * cfg.block_size):
        if data.numel() - cut > length + 1:
            loss = evaluate(model, data[cut:], length)
            print(f"held-out loss at {length} bytes: {loss:.3f} (perplexity {math.exp(loss):.1f})")
    prompt = data[cut:cut + 32][None]
    print(bytes(model.generate(prompt, 64)[0].tolist()).decode("utf-8", "replace"))


if __name__ == "__main__":
    main()
