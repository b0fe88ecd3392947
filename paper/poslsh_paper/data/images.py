"""Images, offline: Fashion-MNIST from the Debian package ``dataset-fashion-mnist``, and a tiny
synthetic image set for tests.

Fashion-MNIST (Xiao et al., 2017): 60,000 training and 10,000 test grayscale images of 28 x 28
pixels in 10 classes, shipped as gzipped IDX files under ``/usr/share/datasets/fashion-mnist``
(``apt-get install dataset-fashion-mnist``; ``$POSLSH_FASHION_MNIST_ROOT`` overrides the path).
Nothing is downloaded.
"""
from __future__ import annotations

import gzip
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ImageSet", "ImagesNotFound", "FASHION_MNIST_CLASSES", "fashion_mnist_root", "load_fashion_mnist",
           "synthetic_images", "load_images", "subset", "to_float", "upsample"]

FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_ENV = "POSLSH_FASHION_MNIST_ROOT"
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")
_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
          "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


class ImagesNotFound(FileNotFoundError):
    """The image data set is not installed; the message says how to install it."""


@dataclass(frozen=True)
class ImageSet:
    """Images ``[N, H, W]`` uint8 (0..255) and labels ``[N]`` int64 of one split."""

    images: Tensor
    labels: Tensor
    classes: Tuple[str, ...]
    source: str

    def __len__(self) -> int:
        return self.labels.numel()


def fashion_mnist_root() -> Path:
    return Path(os.environ.get(FASHION_MNIST_ENV, FASHION_MNIST_DEFAULT_ROOT))


def _read_idx(path: Path, magic: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    got, = struct.unpack(">i", data[:4])
    if got != magic:
        raise ValueError(f"{path} is not an IDX file of the expected kind (magic {got}, expected {magic})")
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "i" * ndim, data[4:4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != math.prod(dims):
        raise ValueError(f"{path} is truncated: {body.size} bytes for shape {dims}")
    return body.reshape(dims)


def load_fashion_mnist(split: str, root: Optional[Path] = None) -> ImageSet:
    """The ``train`` (60,000) or ``test`` (10,000) split of Fashion-MNIST, read from the Debian
    package's files. Raises :class:`ImagesNotFound` with the install command when missing."""
    if split not in _FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = fashion_mnist_root() if root is None else Path(root)
    paths = [root / name for name in _FILES[split]]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise ImagesNotFound(
            f"Fashion-MNIST not found ({missing[0]} is missing): install the Debian package with "
            f"`sudo apt-get install {FASHION_MNIST_PACKAGE}` (files land in {FASHION_MNIST_DEFAULT_ROOT}), or point "
            f"${FASHION_MNIST_ENV} at a directory holding {', '.join(_FILES[split])}; or use --dataset synthetic")
    images = torch.from_numpy(_read_idx(paths[0], 2051).copy())
    labels = torch.from_numpy(_read_idx(paths[1], 2049).astype(np.int64))
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{paths[0].name} has {images.shape[0]} images but {paths[1].name} {labels.shape[0]} labels")
    return ImageSet(images, labels, FASHION_MNIST_CLASSES, f"Fashion-MNIST {split} ({root})")


def synthetic_images(count: int, size: int = 28, *, seed: int = 0) -> ImageSet:
    """A tiny learnable stand-in for tests: 10 classes of stripes (horizontal or vertical, 5
    periods) with a random phase, a random box cut-out and noise; uint8 ``[count, size, size]``."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (count,), generator=g)
    period = (2 + labels % 5).to(torch.float64)[:, None, None]
    axis = torch.arange(size, dtype=torch.float64)
    phase = torch.rand(count, 1, 1, generator=g, dtype=torch.float64) * 2 * math.pi
    coord = torch.where((labels < 5)[:, None, None], axis[None, :, None], axis[None, None, :])
    img = 0.5 + 0.4 * torch.sin(2 * math.pi * coord / period + phase)
    img = img.expand(count, size, size) + 0.1 * torch.randn(count, size, size, generator=g, dtype=torch.float64)
    return ImageSet((img.clamp(0, 1) * 255).round().to(torch.uint8), labels,
                    tuple(f"{'horizontal' if c < 5 else 'vertical'} stripes, period {2 + c % 5}" for c in range(10)),
                    f"synthetic stripes (seed {seed})")


def load_images(dataset: str, split: str, *, synthetic_count: int = 512) -> ImageSet:
    """``fashion-mnist`` (the Debian package) or ``synthetic`` (:func:`synthetic_images`)."""
    if dataset == "fashion-mnist":
        return load_fashion_mnist(split)
    if dataset == "synthetic":
        return synthetic_images(synthetic_count, seed=0 if split == "train" else 1)
    raise ValueError(f"dataset must be 'fashion-mnist' or 'synthetic', got {dataset!r}")


def subset(data: ImageSet, count: int, seed: int) -> ImageSet:
    """``count`` images drawn without replacement by a seeded permutation (all when ``count`` is
    0 or at least the set's size); the same ``(count, seed)`` always gives the same images."""
    n = len(data)
    if count <= 0 or count >= n:
        return data
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:count].sort().values
    return ImageSet(data.images[idx], data.labels[idx], data.classes, f"{data.source}, {count} of {n}")


def to_float(images: Tensor) -> Tensor:
    """uint8 ``[N, H, W]`` -> float32 ``[N, 1, H, W]`` normalised to mean 0, std 1 (Fashion-MNIST's
    pixel statistics, 0.286 and 0.353)."""
    return ((images.to(torch.float32) / 255.0 - 0.2860) / 0.3530)[:, None]


def upsample(images: Tensor, factor: int) -> Tensor:
    """``[N, C, H, W]`` -> ``[N, C, factor H, factor W]`` by bilinear interpolation (factor 1: unchanged)."""
    if factor == 1:
        return images
    return F.interpolate(images, scale_factor=factor, mode="bilinear", align_corners=False)
