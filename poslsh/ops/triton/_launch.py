"""Kernel launchers: the plan (one kernel, cached), grids, autotuning, input checks.

The kernels of :mod:`._kernels` are loaded in one of two modes, decided per call:

* compiled (``triton.jit``) for CUDA tensors, with ``triton.autotune`` over a
  short list of configurations (:mod:`._config`: keyed on ``log2 n``, the head
  dims, causality, dtype and TMA use; pruned by shared memory before compiling);
  ``POSLSH_TRITON_AUTOTUNE=0`` takes the first configuration that fits instead;
* interpreted (``TRITON_INTERPRET=1`` semantics) for CPU tensors, or for any
  tensor while the environment variable is set: fixed small tiles (tests).

Triton picks interpreter or compiler when a function is *decorated*, so the
kernel package (:mod:`._kernels`) is executed once per mode (with the variable set
accordingly) under its own name, and kept; nothing global is left changed.

Launches per call on a GPU: forward 2 (one-hot, label-compare; +1 the first time a plan is
built), backward 5 (``delta``, dk/dv x 2, dq x 2); one per kernel under the interpreter or with
``POSLSH_TRITON_SPLIT=0``. :func:`_launch` counts them (:data:`LAUNCHES`) and pins the device.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import threading
from collections import Counter
from types import ModuleType
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

import triton

from . import _config, _plan
from ._config import MAX_HEAD_DIM, R_MAX, SAMPLE_CHUNK, SUPPORTED_DTYPES, check_inputs  # noqa: F401

_lock = threading.Lock()
_modules: Dict[bool, ModuleType] = {}
_tuned: Dict[str, object] = {}
LAUNCHES: Counter = Counter()          # kernel name -> launches (this process)

# Tile sizes used under the interpreter (tests); multiples of 16, >= 16 (tl.dot).
INTERPRET_BLOCKS = {"fwd": (32, 32), "dkdv": (32, 32), "dq": (32, 32)}
# None: TMA tensor descriptors when possible (see use_tma); True/False: forced (tests).
FORCE_TMA = None
# Blocks per program tile up to which the count is the one-hot MMA (tests lower it to force label compares).
ONEHOT_MAX = {"r_max": R_MAX}
# Two launches per kernel, one-hot programs then label-compare programs (each kernel holds one
# count method: fewer registers, see docs/triton.md), or one launch that picks per program.
# None: split when compiled (or POSLSH_TRITON_SPLIT=0/1), one launch under the interpreter.
SPLIT = None


def split_paths(interpret: bool) -> Tuple[int, ...]:
    """``PATH`` values to launch: ``(1, 2)`` (one-hot, compares) or ``(0,)`` (both in one)."""
    split = SPLIT
    if split is None:
        env = os.environ.get("POSLSH_TRITON_SPLIT")
        split = (env != "0") if env is not None else not interpret
    return (1, 2) if split else (0,)
PLAN_BLOCK = 1024


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def use_interpreter(t: Tensor) -> bool:
    """CPU tensors only run under the interpreter; CUDA ones do when it is requested."""
    return t.device.type != "cuda" or interpret_requested()


def kernels(interpret: bool) -> ModuleType:
    """The kernel package decorated for ``interpret`` mode (loaded once per mode): executed as
    ``_kernels_interpreted`` / ``_kernels_compiled``, whose relative imports load that mode's copy
    of every kernel module."""
    mod = _modules.get(interpret)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(interpret)
        if mod is None:
            where = os.path.join(os.path.dirname(__file__), "_kernels")
            name = f"{__package__}._kernels_{'interpreted' if interpret else 'compiled'}"
            spec = importlib.util.spec_from_file_location(name, os.path.join(where, "__init__.py"),
                                                          submodule_search_locations=[where])
            mod = importlib.util.module_from_spec(spec)
            old = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
            sys.modules[name] = mod
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                    del sys.modules[key]
                raise
            finally:
                if old is None:
                    os.environ.pop("TRITON_INTERPRET", None)
                else:
                    os.environ["TRITON_INTERPRET"] = old
            _modules[interpret] = mod
    return mod


def _device_guard(t: Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _launch(name: str, kernel, grid, args: dict, meta: dict, device_tensor: Tensor) -> None:
    """Launch ``kernel[grid](**args, **meta)`` (every argument by its parameter name, so a
    reordered kernel signature cannot shift them) on ``device_tensor``'s device; count it."""
    with _device_guard(device_tensor):
        kernel[grid](**args, **meta)
    LAUNCHES[name] += 1


# ------------------------------------------------------------------ autotuning
# launch name -> kernel (positional LSH; "w...": the window op's)
KERNEL_FNS = {"fwd": "_fwd_kernel", "dkdv": "_bwd_dkdv_kernel", "dq": "_bwd_dq_kernel",
              "wfwd": "_win_fwd_kernel", "wdkdv": "_win_dkdv_kernel", "wdq": "_win_dq_kernel"}


def _autotuned(name: str):
    """The autotuner of configuration list ``name`` (:data:`._config.CONFIGS`)."""
    fn = _tuned.get(name)
    if fn is None:
        kernel = getattr(kernels(False), KERNEL_FNS[name.split("/")[0]])
        fn = triton.autotune(configs=_config.CONFIGS[name], key=_config.TUNE_KEYS[name],
                             prune_configs_by={"early_config_prune": _config.pruner(name)})(kernel)
        _tuned[name] = fn
    return fn


def _check_blocks(bm: int, bn: int) -> None:
    if bm % 16 or bn % 16 or bm < 16 or bn < 16 or bm & (bm - 1) or bn & (bn - 1):
        raise ValueError(f"tile sizes must be powers of two >= 16, got {(bm, bn)}")


def _kernel_and_metas(name: str, interpret: bool, blocks: Optional[Tuple[int, int]], common: dict, q: Tensor,
                      path=None):
    """``(kernel, [meta, ...])``: the kernel and the launch options to try in order
    (explicit tiles under the interpreter or with ``blocks``; the pruned configuration
    list of the launch (``PATH`` 2 has its own) when autotuning is off; the autotuner, with no
    options, otherwise)."""
    raw = getattr(kernels(interpret), KERNEL_FNS[name])
    name = _config.list_name(name, path)
    if interpret or blocks is not None:
        bm, bn = blocks if blocks is not None else INTERPRET_BLOCKS[_config.KIND[name]]
        _check_blocks(bm, bn)
        if max(bm, bn) > _config.CLASS_TILE[_config.KIND[name]]:
            raise ValueError(f"tiles {(bm, bn)} larger than the class tile {_config.CLASS_TILE[_config.KIND[name]]}")
        meta = {"BLOCK_M": bm, "BLOCK_N": bn}
        if not interpret:
            meta.update(num_warps=4 if bm * bn <= 64 * 64 else 8, num_stages=2)
        return raw, [meta]
    if os.environ.get("POSLSH_TRITON_AUTOTUNE", "1") == "0":
        configs = _config.prune(name, _config.CONFIGS[name], {"Q": q}, **common)
        return raw, [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in configs]
    return _autotuned(name), [{}]


def _run(name: str, interpret: bool, blocks, grid, args, common: dict, q: Tensor, paths=None) -> None:
    """Launch kernel ``name`` once per count path (``paths=(None,)``: a kernel without one);
    without autotuning, the first configuration that fits."""
    from triton.runtime.errors import OutOfResources
    for path in split_paths(interpret) if paths is None else paths:
        kernel, metas = _kernel_and_metas(name, interpret, blocks, common, q, path)
        extra = {} if path is None else {"PATH": path, "CLASS_TILE": _config.CLASS_TILE[name]}
        for i, meta in enumerate(metas):
            try:
                _launch(name, kernel, grid, args, dict(meta, **extra, **common), q)
                break
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


# ------------------------------------------------------------------ the plan
def build_plan(widths: Tensor, offsets: Tensor, n: int, group: int, groups: Optional[Tensor] = None) -> _plan.Plan:
    """The plan (:mod:`._plan`) from one launch of ``_plan_kernel`` (interpreted on CPU);
    for grouped partitions also the lattice indices (plain torch, ``O(H G n)``)."""
    H, S = widths.shape
    dev = widths.device
    n_gran = triton.cdiv(n, _plan.GRANULE)
    ids = torch.empty(H, S, n, dtype=torch.int32, device=dev)
    gran = torch.empty(2, H, S, n_gran, dtype=torch.int32, device=dev)
    order = torch.empty(H + H // group, dtype=torch.int32, device=dev)
    n_blk = triton.cdiv(n, PLAN_BLOCK)
    w = widths.to(torch.float64).contiguous()
    c = offsets.to(torch.float64).contiguous()
    mod = kernels(use_interpreter(w))
    _launch("plan", mod._plan_kernel, (H * S * n_blk + 1,),
            dict(W=w, C=c, IDS=ids, GRAN=gran, ORDER=order, n=n, n_gran=n_gran, H=H, S=S, G=group, n_blk=n_blk),
            dict(BLOCK=PLAN_BLOCK, H_PAD=_pow2(H, 2)), w)
    if groups is None:
        return _plan.Plan(ids, gran, order)
    return _plan.Plan(ids, gran, order, *_plan.lattice_index(w, c, groups, n))


def get_plan(widths: Tensor, offsets: Tensor, n: int, group: int, groups: Optional[Tensor] = None) -> _plan.Plan:
    """The cached plan of these partitions (built on the first call: one launch)."""
    return _plan.cached(widths, offsets, n, group, lambda: build_plan(widths, offsets, n, group, groups),
                        groups=groups)


def _count_args(p: _plan.Plan, S: int) -> Tuple[Tensor, Tensor, int]:
    """``(LAT, KSZ, NC)`` of the label-compare path: the lattice indices of the groups, or
    the samples' block labels (``KSZ`` then unused)."""
    if p.lat is None:
        return p.ids, p.ids, S
    return p.lat, p.ksz, p.lat.shape[-2]


def _meta(q: Tensor, n: int, d: int, dv: int, causal: bool, tma: bool, interpret: bool, lattice: bool) -> dict:
    if tma and not interpret:
        _ensure_allocator()
    return dict(CAUSAL=bool(causal), D=d, DV=dv, HEAD_DIM=_pow2(d), HEAD_DV=_pow2(dv),
                DOT_PREC=dot_precision(q.dtype), USE_TMA=bool(tma), R_MAX=ONEHOT_MAX["r_max"], SC=SAMPLE_CHUNK,
                LATTICE=bool(lattice), ROW_PLANS=False)


def _n_key(n: int) -> int:
    return max(0, int(n) - 1).bit_length()


def strides(prefix: str, x: Tensor) -> dict:
    """The kernels' stride arguments of a ``[B, H, n, d]`` tensor: ``s{prefix}b``, ``...h``, ``...n``."""
    return {f"s{prefix}b": x.stride(0), f"s{prefix}h": x.stride(1), f"s{prefix}n": x.stride(2)}


def _plan_args(p: _plan.Plan, S: int) -> dict:
    """The plan's kernel arguments: its tensors, ``n_gran``, ``gran_stride``, the per-batch-row
    strides of ``ids``, ``gran`` and the compare count's labels (0: one plan for every row), and
    ``S`` / ``NC`` (samples / label rows of the compare count)."""
    lat, ksz, NC = _count_args(p, S)
    ids_bs, gran_bs, lat_bs = _plan.row_strides(p)
    return dict(IDS=p.ids, GRAN=p.gran, ORDER=p.order, LAT=lat, KSZ=ksz, n_gran=p.gran.shape[-1],
                gran_stride=p.gran[0].numel(), ids_bs=ids_bs, gran_bs=gran_bs, lat_bs=lat_bs, S=S, NC=NC)


def _docs_plan(widths, offsets, n, G, groups, doc_start, doc_end) -> _plan.Plan:
    if doc_start is None:
        return get_plan(widths, offsets, n, G, groups)
    if doc_end is None or doc_start.shape != doc_end.shape or doc_start.dim() != 2 or doc_start.shape[1] != n:
        raise ValueError(f"doc_start / doc_end must both be int64 [B, n={n}]")
    return _plan.cached(widths, offsets, n, G, lambda: _plan.document_plan(widths, offsets, n, G, doc_start, doc_end,
                                                                           groups),
                        groups=groups, documents=doc_start)


# ------------------------------------------------------------------ forward
def forward(q: Tensor, k: Tensor, v: Tensor, widths: Tensor, offsets: Tensor, causal: bool, scale: float,
            blocks: Optional[Tuple[int, int]] = None, groups: Optional[Tensor] = None,
            doc_start: Optional[Tensor] = None, doc_end: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``out [B, Hq, n, dv]`` (q.dtype), ``lse [B, Hq, n]`` (fp32, base 2, of the weights ``count``:
    ``log2 sum_k count_ik 2^(qk_ik)``) and ``lse_lo`` (fp32: what rounding ``lse`` to fp32 lost,
    for the backward). ``doc_start`` / ``doc_end``: packed documents (:class:`poslsh.documents.Documents`)."""
    B, Hq, Hkv, n, d, dv, S = check_inputs(q, k, v, widths, offsets)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    G = Hq // Hkv
    interpret = use_interpreter(q)
    out = torch.empty(B, Hq, n, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, n, dtype=torch.float32, device=q.device)
    lse_lo = torch.empty(B, Hq, n, dtype=torch.float32, device=q.device)
    if B == 0:
        return out, lse, lse_lo
    p = _docs_plan(widths, offsets, n, G, groups, doc_start, doc_end)
    common = _meta(q, n, d, dv, causal, use_tma(interpret, q, k, v), interpret, p.lat is not None)
    common["ROW_PLANS"] = _plan.row_strides(p) != (0, 0, 0)
    grid = lambda M: (triton.cdiv(n, M["BLOCK_M"]) * B * Hq,)  # noqa: E731
    _run("fwd", interpret, blocks, grid,
         dict(Q=q, K=k, V=v, Out=out, LSE=lse, LSE_LO=lse_lo, **_plan_args(p, S),
              **strides("q", q), **strides("k", k), **strides("v", v), **strides("o", out),
              n=n, B=B, Hq=Hq, G=G, qk_scale=scale * math.log2(math.e), N_KEY=_n_key(n)), common, q)
    return out, lse, lse_lo


# ------------------------------------------------------------------ backward
def delta_pre(out: Tensor, dout: Tensor, dlse: Optional[Tensor], interpret: bool) -> Tensor:
    """``delta = rowsum(dout * out) - log2(e) dlse`` (fp32 ``[B, Hq, n]``): ``dlse`` is the
    gradient of the base-2 lse (``d lse_i / d s_ij = p_ij / ln 2``)."""
    B, Hq, n, dv = out.shape
    delta = torch.empty(B, Hq, n, dtype=torch.float32, device=out.device)
    has = dlse is not None
    dl = dlse.to(torch.float32).contiguous() if has else delta
    PRE = 64
    nt_pre = triton.cdiv(n, PRE)
    _launch("bwd_pre", kernels(interpret)._bwd_pre_kernel, (nt_pre * B * Hq,),
            dict(O=out, DO=dout, DLSE=dl, DELTA=delta, sob=out.stride(0), soh=out.stride(1), son=out.stride(2),
                 sdb=dout.stride(0), sdh=dout.stride(1), sdn=dout.stride(2), n=n, n_tiles=nt_pre, B=B, Hq=Hq,
                 dlse_scale=math.log2(math.e)),
            dict(DV=dv, HEAD_DV=_pow2(dv), BLOCK=PRE, HAS_DLSE=has), out)
    return delta


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lse_lo: Tensor,
             widths: Tensor, offsets: Tensor, causal: bool, scale: float,
             blocks: Optional[Dict[str, Tuple[int, int]]] = None, groups: Optional[Tensor] = None,
             dlse: Optional[Tensor] = None, doc_start: Optional[Tensor] = None,
             doc_end: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` from the forward's ``out, lse, lse_lo``; ``dlse``: the gradient of the
    (base-2) lse, or None."""
    B, Hq, Hkv, n, d, dv, S = check_inputs(q, k, v, widths, offsets)
    q, k, v, out, dout = (_last_dim_contiguous(x) for x in (q, k, v, out, dout))
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    lse, lse_lo = lse.contiguous(), lse_lo.contiguous()
    G = Hq // Hkv
    interpret = use_interpreter(q)
    dq = torch.empty(B, Hq, n, d, dtype=q.dtype, device=q.device)
    dk = torch.empty(B, Hkv, n, d, dtype=k.dtype, device=q.device)
    dvv = torch.empty(B, Hkv, n, dv, dtype=v.dtype, device=q.device)
    if B == 0:
        return dq, dk, dvv
    p = _docs_plan(widths, offsets, n, G, groups, doc_start, doc_end)
    delta = delta_pre(out, dout, dlse, interpret)
    common = _meta(q, n, d, dv, causal, use_tma(interpret, q, k, v, dout), interpret, p.lat is not None)
    common["ROW_PLANS"] = _plan.row_strides(p) != (0, 0, 0)
    qk_scale = scale * math.log2(math.e)
    blocks = blocks or {}

    args = dict(Q=q, K=k, V=v, DO=dout, LSE=lse, LSE_LO=lse_lo, DELTA=delta, **_plan_args(p, S),
                **strides("q", q), **strides("k", k), **strides("v", v), **strides("d", dout),
                n=n, B=B, Hq=Hq, G=G, qk_scale=qk_scale, sm_scale=scale, N_KEY=_n_key(n))
    grid = lambda M: (triton.cdiv(n, M["BLOCK_N"]) * B * Hkv,)  # noqa: E731
    _run("dkdv", interpret, blocks.get("dkdv"), grid,
         dict(args, DK=dk, DVt=dvv, Hkv=Hkv, **strides("dk", dk), **strides("dv", dvv)), common, q)
    grid = lambda M: (triton.cdiv(n, M["BLOCK_M"]) * B * Hq,)  # noqa: E731
    _run("dq", interpret, blocks.get("dq"), grid, dict(args, DQ=dq, **strides("dq", dq)), common, q)
    return dq, dk, dvv
