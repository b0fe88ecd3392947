"""Kernel launchers: tile configurations, autotuning, grids, input checks.

The kernels of :mod:`._kernels` are loaded in one of two modes, decided per call:

* compiled (``triton.jit``) for CUDA tensors, with ``triton.autotune`` over a
  short list of H100/H200-sized configurations (keyed on ``log2 n``, ``s``, the
  head dims, causality, dtype and TMA use); ``POSLSH_TRITON_AUTOTUNE=0`` takes
  the first configuration of each list instead (no tuning: a fast first call);
* interpreted (``TRITON_INTERPRET=1`` semantics) for CPU tensors, or for any
  tensor while the environment variable is set: fixed small tiles, used by the
  CPU tests.

Triton picks interpreter or compiler when a function is *decorated*, so the
kernel module is executed once per mode (with the variable set accordingly) and
kept; nothing global is left changed.
"""
from __future__ import annotations

import importlib.util
import math
import os
import threading
from types import ModuleType
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

import triton

from . import _plan

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
MAX_SAMPLES = 128     # the per-sample loop is unrolled at compile time

_lock = threading.Lock()
_modules: Dict[bool, ModuleType] = {}
_tuned: Dict[str, object] = {}

# Tile sizes used under the interpreter (tests); multiples of 16, >= 16 (tl.dot).
INTERPRET_BLOCKS = {"fwd": (32, 32), "dkdv": (32, 32), "dq": (32, 32)}
# None: TMA tensor descriptors when possible (see use_tma); True/False: forced (tests).
FORCE_TMA = None


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def use_interpreter(t: Tensor) -> bool:
    """CPU tensors only run under the interpreter; CUDA ones do when it is requested."""
    return t.device.type != "cuda" or interpret_requested()


def kernels(interpret: bool) -> ModuleType:
    """The kernel module decorated for ``interpret`` mode (loaded once per mode)."""
    mod = _modules.get(interpret)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(interpret)
        if mod is None:
            path = os.path.join(os.path.dirname(__file__), "_kernels.py")
            name = f"{__package__}._kernels_{'interpreted' if interpret else 'compiled'}"
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            old = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
            try:
                spec.loader.exec_module(mod)
            finally:
                if old is None:
                    os.environ.pop("TRITON_INTERPRET", None)
                else:
                    os.environ["TRITON_INTERPRET"] = old
            _modules[interpret] = mod
    return mod


# ------------------------------------------------------------------ autotuning
def _cfg(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


# Chosen from compile-only checks for sm_90 (bf16, d=128, s=10, causal, TMA loads),
# keeping the tiles whose register use spills little (<= ~400 bytes); see docs/triton.md.
# The first entry of each list is the default when autotuning is off.
# Forward: BLOCK_M query rows per program, BLOCK_N keys per step.
FWD_CONFIGS = [
    _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3), _cfg(128, 32, 8, 3), _cfg(128, 64, 8, 2),
]
# dk/dv: BLOCK_N keys per program, BLOCK_M queries per step.
DKDV_CONFIGS = [
    _cfg(32, 64, 8, 3), _cfg(64, 64, 8, 3), _cfg(16, 64, 4, 3),
]
# dq: BLOCK_M queries per program, BLOCK_N keys per step.
DQ_CONFIGS = [
    _cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3), _cfg(128, 32, 8, 3), _cfg(64, 32, 4, 3),
]
_TUNE_KEY = ["N_KEY", "S", "CAUSAL", "D", "DV", "DOT_PREC", "USE_TMA"]


def _prune(configs, named_args, **kwargs):
    """Drop tiles whose shared memory / registers cannot fit large head dims."""
    hd = max(int(named_args.get("HEAD_DIM", kwargs.get("HEAD_DIM", 64))),
             int(named_args.get("HEAD_DV", kwargs.get("HEAD_DV", 64))))
    fp32 = named_args.get("DOT_PREC", kwargs.get("DOT_PREC", "tf32")) != "tf32"
    keep = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        limit = 128 * 128 if hd <= 64 else (128 * 64 if hd <= 128 else 64 * 64)
        if fp32:
            limit //= 2
        if bm * bn <= limit:
            keep.append(c)
    return keep or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def _autotuned(name: str):
    fn = _tuned.get(name)
    if fn is None:
        mod = kernels(False)
        kernel, configs = {"fwd": (mod._fwd_kernel, FWD_CONFIGS),
                           "dkdv": (mod._bwd_dkdv_kernel, DKDV_CONFIGS),
                           "dq": (mod._bwd_dq_kernel, DQ_CONFIGS)}[name]
        fn = triton.autotune(configs=configs, key=_TUNE_KEY,
                             prune_configs_by={"early_config_prune": _prune})(kernel)
        _tuned[name] = fn
    return fn


def _check_blocks(bm: int, bn: int) -> None:
    if bm % 16 or bn % 16 or bm < 16 or bn < 16 or bm & (bm - 1) or bn & (bn - 1):
        raise ValueError(f"tile sizes must be powers of two >= 16, got {(bm, bn)}")


def _kernel_and_blocks(name: str, interpret: bool, blocks: Optional[Tuple[int, int]]):
    """``(kernel, [meta, ...])``: the kernel and the launch options to try in order
    (explicit tiles under the interpreter or with ``blocks``; the configuration list
    when autotuning is off; the autotuner, with no options, otherwise)."""
    mod = kernels(interpret)
    raw = {"fwd": mod._fwd_kernel, "dkdv": mod._bwd_dkdv_kernel, "dq": mod._bwd_dq_kernel}[name]
    if interpret or blocks is not None:
        bm, bn = blocks if blocks is not None else INTERPRET_BLOCKS[name]
        _check_blocks(bm, bn)
        meta = {"BLOCK_M": bm, "BLOCK_N": bn}
        if not interpret:
            meta.update(num_warps=4 if bm * bn <= 64 * 64 else 8, num_stages=2)
        return raw, [meta]
    if os.environ.get("POSLSH_TRITON_AUTOTUNE", "1") == "0":
        configs = {"fwd": FWD_CONFIGS, "dkdv": DKDV_CONFIGS, "dq": DQ_CONFIGS}[name]
        return raw, [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in configs]
    return _autotuned(name), [{}]


def _run(name: str, interpret: bool, blocks, grid, args, common: dict) -> None:
    """Launch kernel ``name``; without autotuning, the first configuration (after the
    pruning rule) that fits the device's shared memory / registers."""
    kernel, metas = _kernel_and_blocks(name, interpret, blocks)
    if len(metas) > 1:
        keep = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in _prune(
            [triton.Config({"BLOCK_M": m["BLOCK_M"], "BLOCK_N": m["BLOCK_N"]}) for m in metas], common)}
        metas = [m for m in metas if (m["BLOCK_M"], m["BLOCK_N"]) in keep]
    from triton.runtime.errors import OutOfResources
    for i, meta in enumerate(metas):
        try:
            kernel[grid](*args, **meta, **common)
            return
        except OutOfResources:
            if i == len(metas) - 1:
                raise


# ------------------------------------------------------------------ helpers
def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << (int(x) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of ``tl.dot``: float32 inputs get 3xTF32 (about float32
    accuracy on tensor cores; plain IEEE on AMD); 16-bit inputs ignore it."""
    if dtype != torch.float32:
        return "tf32"
    return "ieee" if torch.version.hip else "tf32x3"


def check_inputs(q: Tensor, k: Tensor, v: Tensor, widths: Tensor, offsets: Tensor) -> Tuple[int, int, int, int, int, int, int]:
    """Kernel constraints, checked with messages; returns ``B, Hq, Hkv, n, d, dv, s``."""
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
    if not 1 <= S <= MAX_SAMPLES:
        raise ValueError(f"the triton backend supports 1..{MAX_SAMPLES} samples per head, got {S}")
    if widths.device != q.device or offsets.device != q.device or k.device != q.device or v.device != q.device:
        raise ValueError("q, k, v and the partitions must be on one device")
    return B, Hq, Hkv, n, d, dv, S


def use_tma(interpret: bool, *tensors: Tensor) -> bool:
    """Stream the K/V (forward, dq) and Q/dO (dk/dv) tiles through TMA tensor
    descriptors: on Hopper or newer, when every base address and leading stride is a
    multiple of 16 bytes (a TMA requirement). Descriptors pad rows past ``n`` and
    columns past ``d`` with zeros and cost no per-element address registers, which
    keeps the kernels from spilling. Otherwise plain pointer loads with masks.
    ``POSLSH_TRITON_TMA=0`` turns them off."""
    if FORCE_TMA is not None:
        return bool(FORCE_TMA)
    if os.environ.get("POSLSH_TRITON_TMA", "1") == "0":
        return False
    if not interpret:
        dev = tensors[0].device
        if dev.type != "cuda" or torch.version.hip or torch.cuda.get_device_capability(dev)[0] < 9:
            return False
    for t in tensors:
        es = t.element_size()
        if t.data_ptr() % 16 or any((st * es) % 16 for st in t.stride()[:-1]):
            return False
    return True


def _torch_allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-side tensor descriptors need scratch memory from ``triton.set_allocator``.
    The allocator lives in a ContextVar (per thread: autograd runs backward in its
    own thread), so this is checked before every launch; a user's allocator is kept."""
    try:
        from triton.runtime import _allocation
        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):
        pass
    triton.set_allocator(_torch_allocator)


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _plan_for(widths: Tensor, offsets: Tensor, n: int, group: int, interpret: bool):
    """``_plan.plan``, with the ``[H, s, n]`` labels from one Triton kernel when compiled
    (the torch version makes several float64 passes over ``H s n`` elements)."""
    if interpret:
        return _plan.plan(widths, offsets, n, group)
    H, S = widths.shape
    ids = torch.empty(H, S, n, dtype=torch.int32, device=widths.device)
    BLOCK = 1024
    kernels(False)._ids_kernel[(triton.cdiv(n, BLOCK), H * S)](
        widths.to(torch.float64).contiguous(), offsets.to(torch.float64).contiguous(), ids, n, BLOCK=BLOCK)
    return ids, _plan.granule_bounds(widths, offsets, n), _plan.head_order(widths, n, group)


def _meta(q: Tensor, n: int, d: int, dv: int, S: int, causal: bool, tma: bool, interpret: bool):
    if tma and not interpret:
        _ensure_allocator()
    return dict(S=S, S_PAD=_pow2(S, 2), CAUSAL=bool(causal), D=d, DV=dv,
                HEAD_DIM=_pow2(d), HEAD_DV=_pow2(dv), DOT_PREC=dot_precision(q.dtype), USE_TMA=bool(tma))


def _n_key(n: int) -> int:
    return max(0, int(n) - 1).bit_length()


# ------------------------------------------------------------------ forward
def forward(q: Tensor, k: Tensor, v: Tensor, widths: Tensor, offsets: Tensor, causal: bool, scale: float,
            blocks: Optional[Tuple[int, int]] = None) -> Tuple[Tensor, Tensor]:
    """``out [B, Hq, n, dv]`` (q.dtype) and ``lse [B, Hq, n]`` (fp32, log2 domain, incl. ``1/s``)."""
    B, Hq, Hkv, n, d, dv, S = check_inputs(q, k, v, widths, offsets)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    G = Hq // Hkv
    interpret = use_interpreter(q)
    ids, gran, order = _plan_for(widths, offsets, n, G, interpret)
    out = torch.empty(B, Hq, n, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, n, dtype=torch.float32, device=q.device)
    if B == 0:
        return out, lse
    common = _meta(q, n, d, dv, S, causal, use_tma(interpret, q, k, v), interpret)
    grid = lambda M: (triton.cdiv(n, M["BLOCK_M"]), B * Hq)  # noqa: E731
    _run("fwd", interpret, blocks, grid,
         (q, k, v, ids, gran, order, out, lse,
          q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
          v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
          n, gran.shape[-1], gran[0].numel(), Hq, G, scale * math.log2(math.e), math.log2(S), _n_key(n)), common)
    return out, lse


# ------------------------------------------------------------------ backward
def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             widths: Tensor, offsets: Tensor, causal: bool, scale: float,
             blocks: Optional[Dict[str, Tuple[int, int]]] = None) -> Tuple[Tensor, Tensor, Tensor]:
    B, Hq, Hkv, n, d, dv, S = check_inputs(q, k, v, widths, offsets)
    q, k, v, out, dout = (_last_dim_contiguous(x) for x in (q, k, v, out, dout))
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    lse = lse.contiguous()
    G = Hq // Hkv
    interpret = use_interpreter(q)
    ids, gran, order = _plan_for(widths, offsets, n, G, interpret)
    dq = torch.empty(B, Hq, n, d, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hkv, n, d, dtype=k.dtype, device=q.device)
    dvv = torch.empty(B, Hkv, n, dv, dtype=v.dtype, device=q.device)
    if B == 0:
        return dq, dk, dvv
    mod = kernels(interpret)
    delta = torch.empty(B, Hq, n, dtype=torch.float32, device=q.device)
    PRE = 64
    mod._bwd_pre_kernel[(triton.cdiv(n, PRE), B * Hq)](
        out, dout, delta, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), n, Hq,
        DV=dv, HEAD_DV=_pow2(dv), BLOCK=PRE)
    common = _meta(q, n, d, dv, S, causal, use_tma(interpret, q, k, v, dout), interpret)
    qk_scale = scale * math.log2(math.e)
    blocks = blocks or {}

    grid = lambda M: (triton.cdiv(n, M["BLOCK_N"]), B * Hkv)  # noqa: E731
    _run("dkdv", interpret, blocks.get("dkdv"), grid,
         (q, k, v, dout, lse, delta, ids, gran, order, dk, dvv,
          q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
          v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
          dk.stride(0), dk.stride(1), dk.stride(2), dvv.stride(0), dvv.stride(1), dvv.stride(2),
          n, gran.shape[-1], gran[0].numel(), Hq, Hkv, G, qk_scale, scale, math.log2(S), _n_key(n)), common)

    grid = lambda M: (triton.cdiv(n, M["BLOCK_M"]), B * Hq)  # noqa: E731
    _run("dq", interpret, blocks.get("dq"), grid,
         (q, k, v, dout, lse, delta, ids, gran, order, dq,
          q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
          v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
          dq.stride(0), dq.stride(1), dq.stride(2),
          n, gran.shape[-1], gran[0].numel(), Hq, G, qk_scale, scale, math.log2(S), _n_key(n)), common)
    return dq, dk, dvv
