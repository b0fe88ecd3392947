"""A small ViT over patch tokens whose attention carries one positional method.

Patches (``patch_size`` pixels square, a linear embedding) form a ``Gr x Gc`` grid of tokens in
raster order; pre-norm blocks; mean pooling (no class token: it has no place on the grid); a
linear head. The positional method lives in the attention:

* ``learned``: a learned ``[dim, Gr, Gc]`` table added to the patch embeddings. At another
  resolution it is resized bicubically to the new grid (the ViT/DeiT recipe for fine-tuning at
  higher resolution), with no further training: the only way learned positions reach 4x the tokens.
* ``alibi-1d``: ALiBi on the raster index, bias ``-|i - j| / sigma_h`` (exact, dense).
* ``alibi-2d``: 2-D ALiBi, bias ``-||x_i - x_j||_1 / sigma_h`` (exact, dense).
* ``poslsh``: 2-D positional LSH with ``s`` random boxes per head (:func:`poslsh.poslsh_attention_nd`):
  fresh boxes per training step and layer, fixed ones per layer in eval mode.
* ``fixed-boxes``: one fixed partition into ``fixed_box x fixed_box`` patch boxes per head.

Every head ``h`` uses the same ``sigma_h`` (:func:`~.config.head_sigmas`) in all the ALiBi-like methods.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from poslsh.alibi import alibi_bias
from poslsh.attention import poslsh_attention_nd
from poslsh.modules import PartitionSchedule
from poslsh.partitions_nd import PartitionsND, grid_coords
from poslsh.reference import alibi_bias_nd
from poslsh_paper.experiments.vision.config import Method, ViTConfig, head_sigmas

__all__ = ["ViT", "Attention", "TRAIN_GRID"]

TRAIN_GRID = 28   # training images are 28 x 28 pixels


class Attention(nn.Module):
    """Multi-head self-attention with the method's positional bias or boxes. Records its last
    ``q, k, v`` (``[B, H, n, hd]``) when ``record`` is set (the convergence figure reads them)."""

    def __init__(self, dim: int, heads: int, method: Method, sigma: Tensor, layer: int, fixed_box: int,
                 backend: str):
        super().__init__()
        self.heads, self.method, self.layer, self.backend = heads, method, layer, backend
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("sigma", sigma.clone(), persistent=False)
        self.fixed_box = fixed_box
        self.seed = 0                 # run seed: partitions of step t come from (seed, t, layer)
        self.eval_seed = 0            # fixed evaluation partitions come from (eval_seed, layer)
        self.record = False
        self.sigma_mult = 1.0         # evaluation at k x resolution with distances in training patches: k
        self.recorded: Optional[Tuple[Tensor, Tensor, Tensor]] = None
        self._bias: Dict[Tuple[int, int], Tensor] = {}

    def partitions(self, step: Optional[int]) -> PartitionsND:
        """The boxes of the next call, on the layer's device: :class:`poslsh.PartitionSchedule`'s rule
        (fresh per (seed, step, layer) in training, fixed per (eval_seed, layer) in evaluation; seeds
        tagged ``"vision-"``), at ``sigma * sigma_mult`` in evaluation."""
        if self.method.kind == "fixed-boxes":
            side = max(1, round(self.fixed_box * self.sigma_mult))
            return PartitionsND.fixed_blocks(self.heads, (side, side))
        if self.training and step is None:
            raise ValueError("PosLSH training needs the step (model(images, step=t)) to draw its boxes")
        mult = self.sigma_mult if not self.training else 1.0   # training draws at the trained sigma
        key = (self.seed, self.eval_seed, mult, self.method.num_samples)
        schedules = self.__dict__.setdefault("_schedules", {})     # one schedule per (seeds, sigma multiple)
        if key not in schedules:
            schedules[key] = PartitionSchedule(self.sigma.detach().cpu().double() * mult, self.method.num_samples,
                                               layer=self.layer, seed=self.seed, eval_seed=self.eval_seed, dims=2,
                                               tag="vision-")
        return schedules[key].partitions(self.training, step, self.sigma.device)

    def bias(self, grid: Tuple[int, int], device) -> Tensor:
        """The exact dense bias ``[H, n, n]`` of the ALiBi methods, cached per grid."""
        key = (grid, self.sigma_mult)
        if key not in self._bias:
            slopes = 1.0 / (self.sigma.cpu().double() * self.sigma_mult)
            if self.method.kind == "alibi-1d":
                b = alibi_bias(grid[0] * grid[1], slopes, dtype=torch.float32)
            else:
                b = alibi_bias_nd(grid_coords(*grid), slopes, dtype=torch.float32)
            self._bias[key] = b.to(device)
        return self._bias[key]

    def forward(self, x: Tensor, grid: Tuple[int, int], step: Optional[int]) -> Tensor:
        B, n, dim = x.shape
        q, k, v = self.qkv(x).view(B, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        if self.record:
            self.recorded = (q.detach(), k.detach(), v.detach())
        kind = self.method.kind
        if kind in ("poslsh", "fixed-boxes"):
            out = poslsh_attention_nd(q, k, v, self.partitions(step), grid=grid, backend=self.backend)
        elif kind in ("alibi-1d", "alibi-2d"):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias(grid, x.device)[None])
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(B, n, dim))


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig, method: Method, sigma: Tensor, layer: int, backend: str):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.heads, method, sigma, layer, cfg.fixed_box, backend)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim), nn.GELU(),
                                 nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim))

    def forward(self, x: Tensor, grid: Tuple[int, int], step: Optional[int]) -> Tensor:
        x = x + self.attn(self.norm1(x), grid, step)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """``images [B, 1, H, W]`` (``H, W`` multiples of ``patch_size``) -> ``logits [B, classes]``."""

    def __init__(self, cfg: ViTConfig, method: Method, *, num_classes: int = 10, backend: str = "torch"):
        super().__init__()
        self.cfg, self.method = cfg, method
        self.embed = nn.Conv2d(1, cfg.dim, cfg.patch_size, stride=cfg.patch_size)
        g = TRAIN_GRID // cfg.patch_size
        self.pos = nn.Parameter(torch.randn(1, cfg.dim, g, g) * 0.02) if method.kind == "learned" else None
        sigma = head_sigmas(cfg)                          # float64: the boxes are drawn in float64
        self.blocks = nn.ModuleList(Block(cfg, method, sigma, i, backend) for i in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, num_classes)

    def set_seeds(self, seed: int, eval_seed: int) -> None:
        """Run seed (training partitions) and evaluation seed (fixed eval partitions) of every layer."""
        for blk in self.blocks:
            blk.attn.seed, blk.attn.eval_seed = int(seed), int(eval_seed)

    def set_sigma_mult(self, mult: float) -> None:
        """Multiply every head's sigma (and the fixed box side) by ``mult`` (1 = as trained)."""
        for blk in self.blocks:
            blk.attn.sigma_mult = float(mult)

    def positions(self, grid: Tuple[int, int]) -> Tensor:
        """The learned table at ``grid``: resized bicubically when it differs from the training grid."""
        pos = self.pos
        if tuple(pos.shape[2:]) != grid:
            pos = F.interpolate(pos, size=grid, mode="bicubic", align_corners=False)
        return pos

    def forward(self, images: Tensor, step: Optional[int] = None) -> Tensor:
        x = self.embed(images)                                        # [B, dim, Gr, Gc]
        grid = (x.shape[2], x.shape[3])
        if self.pos is not None:
            x = x + self.positions(grid)
        x = x.flatten(2).transpose(1, 2)                              # [B, n, dim], raster order
        for blk in self.blocks:
            x = blk(x, grid, step)
        return self.head(self.norm(x).mean(1))
