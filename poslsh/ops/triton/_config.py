"""Tile configurations, shared-memory pruning and version checks of the Triton backend.

Nothing here launches a kernel. The configuration lists and the shared-memory
model were set from compile-only checks for sm_90 (``benchmarks/triton_static.py``
compiles every configuration with the installed triton and prints registers,
spills and shared memory next to :func:`smem_estimate`); no timing is behind
them yet (see docs/triton.md).
"""
from __future__ import annotations

import re
from typing import List, Optional, Tuple

import torch
from torch import Tensor
import triton

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
R_MAX = 32            # blocks per program tile up to which the count is a one-hot MMA (K = R_MAX)
SAMPLE_CHUNK = 16     # samples handled per vector step in the range / block-list code
MIN_TRITON = (3, 4)   # tl.make_tensor_descriptor (device-side TMA descriptors)
# Shared memory of a Hopper SM available to one block (227 KiB); used when the device cannot be asked.
DEFAULT_SMEM = 232448


def _version(text: str):
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


TRITON_VERSION = _version(triton.__version__)


def version_problem() -> Optional[str]:
    """Why this triton cannot run the kernels (None when it can)."""
    if TRITON_VERSION < MIN_TRITON:
        return (f"poslsh's triton backend needs triton >= {'.'.join(map(str, MIN_TRITON))} "
                f"(tl.make_tensor_descriptor); found triton {triton.__version__}")
    return None


def interpreter_problem() -> Optional[str]:
    """Why Triton's CPU interpreter cannot run the kernels here (None when it can):
    triton < 3.9 with numpy >= 2.4 fails in the interpreter itself (``int()`` of a
    1-element array, triton-lang/triton#9171, fixed in 3.9)."""
    import numpy
    if TRITON_VERSION < (3, 9) and _version(numpy.__version__) >= (2, 4):
        return (f"triton {triton.__version__}'s interpreter fails with numpy {numpy.__version__} "
                f"(>= 2.4: 'only 0-dimensional arrays can be converted to Python scalars', "
                f"triton-lang/triton#9171, fixed in triton 3.9)")
    return None


# ------------------------------------------------------------------ configurations
def _cfg(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


# The first entry of each list is the default when autotuning is off: the largest tiles that
# spill nothing for bf16 d = 128 under triton 3.6 and 3.9 (benchmarks/triton_static.py --compile
# prints the table). Which count a tile takes is decided on 128 query rows (fwd, dq) or
# 64 keys (dk/dv): CLASS_TILE below.
# Forward: BLOCK_M query rows per program, BLOCK_N keys per step.
FWD_CONFIGS = [_cfg(128, 32, 8, 3), _cfg(128, 64, 8, 3), _cfg(128, 64, 8, 2), _cfg(64, 64, 4, 3)]
# dk/dv: BLOCK_N keys per program, BLOCK_M queries per step.
DKDV_CONFIGS = [_cfg(32, 32, 4, 3), _cfg(32, 64, 8, 3), _cfg(64, 64, 8, 2), _cfg(16, 64, 4, 3)]
# dq: BLOCK_M queries per program, BLOCK_N keys per step.
DQ_CONFIGS = [_cfg(64, 32, 8, 3), _cfg(128, 32, 8, 3), _cfg(128, 64, 8, 2), _cfg(64, 64, 4, 3)]
# Which launch (one-hot or compare) runs a tile is decided on the CLASS_TILE positions holding it
# (forward / dq: query rows; dk/dv: keys), whatever tile a launch uses (<= the class tile).
CLASS_TILE = {"fwd": 128, "dq": 128, "dkdv": 64}
# The label-compare launches (PATH 2: narrow heads, every sample cuts every class tile) tile
# smaller: their count costs ~2 s ALU ops per score, so fewer wasted scores around a narrow band
# pay more than tensor-core efficiency (docs/triton.md, "Narrow heads").
FWD_COMPARE_CONFIGS = [_cfg(64, 32, 8, 3), _cfg(128, 32, 8, 3), _cfg(64, 32, 8, 2)]
DKDV_COMPARE_CONFIGS = [_cfg(32, 32, 4, 3), _cfg(32, 32, 8, 3)]
DQ_COMPARE_CONFIGS = [_cfg(64, 32, 8, 3), _cfg(128, 32, 8, 3)]
# The window op's kernels (no count: fewer live registers) tune over the forward's lists.
CONFIGS = {"fwd": FWD_CONFIGS, "dkdv": DKDV_CONFIGS, "dq": DQ_CONFIGS,
           "fwd/compare": FWD_COMPARE_CONFIGS, "dkdv/compare": DKDV_COMPARE_CONFIGS, "dq/compare": DQ_COMPARE_CONFIGS,
           "wfwd": FWD_CONFIGS, "wdkdv": DKDV_CONFIGS, "wdq": DQ_CONFIGS}
KIND = {name: name.split("/")[0].lstrip("w") for name in CONFIGS}     # the kernel family of a list
# Used only when pruning drops a whole list (fp32 with d = 128, any dtype with d = 256): small
# tiles, no software pipelining.
FALLBACK = {name: _cfg(32, 32, 4, 1) for name in KIND}
TUNE_KEY = ["N_KEY", "CAUSAL", "D", "DV", "DOT_PREC", "USE_TMA", "PATH", "LATTICE", "ROW_PLANS"]
WINDOW_TUNE_KEY = ["N_KEY", "CAUSAL", "D", "DV", "DOT_PREC", "USE_TMA", "HAS_DOCS"]
TUNE_KEYS = {name: WINDOW_TUNE_KEY if name.startswith("w") else TUNE_KEY for name in KIND}
assert all(c.kwargs["BLOCK_N" if KIND[k] == "dkdv" else "BLOCK_M"] <= CLASS_TILE[KIND[k]]
           for k, cs in CONFIGS.items() for c in cs + [FALLBACK[k]])


def list_name(kernel: str, path) -> str:
    """The configuration list of a launch: its own for the label-compare launch (``PATH`` 2)."""
    return f"{kernel}/compare" if path == 2 and f"{kernel}/compare" in CONFIGS else kernel


def smem_estimate(kernel: str, bm: int, bn: int, stages: int, hd: int, hdv: int, elem: int,
                  r_max: int = R_MAX) -> int:
    """Shared memory (bytes) a configuration needs, from its tiles: the program's own
    tile, ``stages`` buffers of the streamed tiles, the one-hot operand and layout
    scratch. An upper bound of what triton allocated for every configuration that
    ``benchmarks/triton_static.py`` compiled for sm_90 (it prints both). ``kernel``: a launch
    name (:data:`KIND`; the window op's kernels hold less: an upper bound for them too)."""
    kernel = KIND.get(kernel, kernel)
    if kernel == "fwd":      # Q [bm, hd]; K, V [bn, hd + hdv] x stages; P / one-hot staging
        own, stream, extra = bm * hd, bn * (hd + hdv), bm * bn + r_max * bn
    elif kernel == "dq":     # Q, dO [bm, hd + hdv]; K, V [bn, hd + hdv] x stages
        own, stream, extra = bm * (hd + hdv), bn * (hd + hdv), bm * bn + r_max * bn
    elif kernel == "dkdv":   # K, V [bn, hd + hdv]; Q, dO [bm, hd + hdv] x stages; pT, dsT
        own, stream, extra = bn * (hd + hdv), bm * (hd + hdv), 2 * bm * bn + r_max * bm
    else:
        raise ValueError(kernel)
    need = (own + stages * stream + extra) * elem + 2 * r_max * bm * 2 + 4096
    # fp32 operands go through 3xTF32 dots, which stage more: compiled fp32 d=128 configurations
    # needed up to 1.41x this model (1.21x-1.41x), so 1.5x is the bound.
    return int(need * 1.5) if elem == 4 else need


def max_shared_memory(device=None) -> int:
    """Shared memory one block may use on ``device`` (opt-in maximum)."""
    if device is not None and getattr(device, "type", None) == "cuda":
        try:
            props = torch.cuda.get_device_properties(device)
            v = getattr(props, "shared_memory_per_block_optin", None)
            if v:
                return int(v)
            return int(triton.runtime.driver.active.utils.get_device_properties(device.index or 0)["max_shared_mem"])
        except Exception:        # noqa: BLE001 - fall back to the Hopper figure
            pass
    return DEFAULT_SMEM


def _arg(named_args: dict, kwargs: dict, name: str, default):
    return named_args.get(name, kwargs.get(name, default))


def prune(kernel: str, configs: List[triton.Config], named_args: dict, **kwargs) -> List[triton.Config]:
    """Drop the configurations whose shared memory (:func:`smem_estimate`) exceeds the
    device's, before anything is compiled (a launch would fail with OutOfResources
    after a compile of 15-40 s). Never empty: when nothing fits, :data:`FALLBACK`."""
    hd = int(_arg(named_args, kwargs, "HEAD_DIM", 64))
    hdv = int(_arg(named_args, kwargs, "HEAD_DV", 64))
    fp32 = _arg(named_args, kwargs, "DOT_PREC", "tf32") != "tf32"
    q = _arg(named_args, kwargs, "Q", None)      # the autotuner passes arguments given by name in kwargs
    limit = max_shared_memory(getattr(q, "device", None))
    elem = 4 if fp32 else 2

    def need(c):
        return smem_estimate(kernel, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages, hd, hdv, elem)
    keep = [c for c in configs if need(c) <= limit]
    return keep or [FALLBACK[kernel]]


def pruner(kernel: str):
    def early_config_prune(configs, named_args, **kwargs):
        return prune(kernel, configs, named_args, **kwargs)
    return early_config_prune


# ------------------------------------------------------------------ input checks
def check_inputs(q: Tensor, k: Tensor, v: Tensor, widths: Tensor,
                 offsets: Tensor) -> Tuple[int, int, int, int, int, int, int]:
    """Kernel constraints, checked with messages; returns ``B, Hq, Hkv, n, d, dv, s``."""
    problem = version_problem()
    if problem is not None:
        raise RuntimeError(problem)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D [batch, heads, seqlen, head_dim]")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the triton backend takes float16, bfloat16 or float32 q/k/v of one dtype, "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Hq, n, d = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    if k.shape != (B, Hkv, n, d) or v.shape[:3] != (B, Hkv, n):
        raise ValueError(f"inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if d > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        raise ValueError(f"the triton backend supports head dims up to {MAX_HEAD_DIM}, got d={d}, dv={dv}")
    if n < 1 or n >= 2 ** 31 - 2 * 128:
        raise ValueError(f"seqlen must be in [1, 2^31 - 256), got {n}")
    if widths.dim() != 2 or widths.shape != offsets.shape or widths.shape[0] != Hq:
        raise ValueError(f"partitions must be [Hq={Hq}, s], got widths {tuple(widths.shape)}, "
                         f"offsets {tuple(offsets.shape)}")
    S = widths.shape[1]
    if S < 1 or Hq * S * n >= 2 ** 31 * 16:
        raise ValueError(f"need 1 <= s and a plan of H * s * n < 2^35 labels, got H={Hq}, s={S}, n={n}")
    if widths.device != q.device or offsets.device != q.device or k.device != q.device or v.device != q.device:
        raise ValueError("q, k, v and the partitions must be on one device")
    if B * Hq * triton.cdiv(n, 16) >= 2 ** 31:
        raise ValueError(f"batch x heads x tiles must stay below 2^31 (one grid axis), got B={B}, H={Hq}, n={n}")
    return B, Hq, Hkv, n, d, dv, S
