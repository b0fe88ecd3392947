"""What the GPU scripts share: the configuration, inputs made on the device, the competitors
(one function each, through the library's public API), a timer and error measures.

Competitors (``METHODS``), all ``f(q, k, v) -> out`` on ``[B, H, n, d]`` tensors:

* ``poslsh-triton``  positional LSH, the fused kernel (``backend="triton"``);
* ``poslsh-flex``    positional LSH through FlexAttention (``backend="flex"``);
* ``poslsh-torch``   positional LSH, the portable torch backend;
* ``window-flex``    ALiBi cut at ``10 sigma_h`` per head on FlexAttention
                     (``windowed_alibi_attention(backend="flex")``: block lists per head + score_mod);
* ``window-triton``  the same window on the Triton kernels (``backend="triton"``);
* ``exact-flex``     exact ALiBi on FlexAttention (the window op with ``window = n``);
* ``sdpa-flash``     dense causal flash attention without any bias (``F.scaled_dot_product_attention``):
                     the dense floor;
* ``fixed-blocks``   the paper's fixed-blocks baseline through the Triton kernel.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "paper"), os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)

import poslsh  # noqa: E402
from poslsh.ops import registry  # noqa: E402

METHODS = ["poslsh-triton", "poslsh-flex", "poslsh-torch", "window-flex", "window-triton", "exact-flex", "sdpa-flash",
           "fixed-blocks"]
BACKEND = {"poslsh-triton": "triton", "poslsh-flex": "flex", "poslsh-torch": "torch", "window-flex": "flex",
           "window-triton": "triton", "exact-flex": "flex", "fixed-blocks": "triton"}
WINDOW_SIGMAS = 10.0


@dataclass(frozen=True)
class Case:
    """One configuration: ``H`` ALiBi heads (query heads; ``Hkv`` key/value heads), ``s`` samples."""

    B: int = 1
    H: int = 16
    Hkv: int = 16
    d: int = 128
    s: int = 10
    dtype: str = "bfloat16"
    causal: bool = True
    sampler: str = "iid"
    seed: int = 0
    device: str = "cuda"
    fixed_block: int = 512

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def describe(self) -> str:
        heads = f"H={self.H}" + (f"/{self.Hkv}" if self.Hkv != self.H else "")
        return (f"{self.dtype}, B={self.B}, {heads}, d={self.d}, s={self.s} {self.sampler}, "
                f"{'causal' if self.causal else 'non-causal'}, {self.device}")


def dry_case(case: Case) -> Case:
    """The CPU dry run's version of a case: float32 (the interpreter's tl.dot on bf16 is wrong),
    2 heads, d = 16, 2 samples, on the CPU."""
    return replace(case, H=2, Hkv=2, d=16, s=2, dtype="float32", device="cpu")


def partitions(case: Case):
    from poslsh.sampling import parse_sampler
    method, group = parse_sampler(case.sampler)
    return poslsh.sample_partitions(poslsh.alibi_sigmas(case.H), case.s, seed=case.seed, sampler=method,
                                    group_size=group).to(case.device)


def inputs(case: Case, n: int, grad: bool = True, seed: Optional[int] = None):
    """``q [B, H, n, d]``, ``k, v [B, Hkv, n, d]``, ``dout`` made on the case's device (no
    float64 copies built on the host)."""
    dev = torch.device(case.device)
    g = torch.Generator(device=dev).manual_seed(case.seed if seed is None else seed)
    mk = lambda h: torch.randn(case.B, h, n, case.d, generator=g, device=dev, dtype=case.torch_dtype)  # noqa: E731
    q, k, v, dout = mk(case.H), mk(case.Hkv), mk(case.Hkv), mk(case.H)
    for t in (q, k, v):
        t.requires_grad_(grad)
    return q, k, v, dout


def window_of(case: Case, n: int, method: str):
    """The window op's ``(slopes, window)``: ``ceil(10 sigma_h)`` per head, or ``n`` (exact ALiBi)."""
    slopes = poslsh.alibi_slopes(case.H)
    if method == "exact-flex":
        return slopes, n
    return slopes, torch.ceil(WINDOW_SIGMAS * poslsh.alibi_sigmas(case.H)).to(torch.int64)


class Unavailable(Exception):
    """The method cannot run here; the message is the one-line reason (the registry's)."""


def interpreter_problem() -> Optional[str]:
    """Under Triton's CPU interpreter (the dry run): why it cannot run the kernels here, in the words
    the tests skip with (triton < 3.9 with numpy >= 2.4: triton-lang/triton#9171); else None."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        from poslsh.ops.triton import _config
    except Exception:       # no triton at all: the registry says so
        return None
    return _config.interpreter_problem()


def can_run(backend: str, op: str, q, needs=()) -> Optional[str]:
    """None when ``backend`` serves ``op`` on ``q``; otherwise the registry's one-line reason (or, in the
    dry run, why Triton's interpreter cannot run here)."""
    poslsh.available_backends()                     # loads the backends
    if backend == "triton" and interpreter_problem():
        return interpreter_problem()
    try:
        registry.resolve(backend, op, q, needs)
    except ValueError as e:
        return str(e)
    return None


def build(method: str, case: Case, n: int, parts=None) -> Callable:
    """``f(q, k, v) -> out`` for ``method``; raises :class:`Unavailable` with the registry's reason."""
    probe = torch.zeros(1, case.H, 1, case.d, device=case.device, dtype=case.torch_dtype)
    if method in ("poslsh-triton", "poslsh-flex", "poslsh-torch", "fixed-blocks"):
        why = can_run(BACKEND[method], "sequence", probe)
        if why:
            raise Unavailable(why)
        if method == "fixed-blocks":
            parts = poslsh.Partitions.fixed_blocks(case.H, case.fixed_block, device=case.device)
        parts = partitions(case) if parts is None else parts
        return lambda q, k, v: poslsh.poslsh_attention(q, k, v, parts, causal=case.causal, backend=BACKEND[method])
    if method in ("window-flex", "window-triton", "exact-flex"):
        why = can_run(BACKEND[method], "window", probe)
        if why:
            raise Unavailable(why)
        slopes, window = window_of(case, n, method)
        return lambda q, k, v: poslsh.windowed_alibi_attention(q, k, v, slopes, window=window, causal=case.causal,
                                                                 backend=BACKEND[method])
    if method == "sdpa-flash":
        if case.device == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def flash(q, k, v):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=case.H != case.Hkv)
            return flash
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal,
                                                              enable_gqa=case.H != case.Hkv)
    raise ValueError(f"unknown method {method!r}; known: {METHODS}")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, budget_ms: float = 400.0, min_reps: int = 3,
            max_reps: int = 50):
    """``(median ms, min ms, repetitions, first call s)``: one untimed first call (compiles),
    then repetitions filling ``budget_ms`` (CUDA events per repetition; wall clock on CPU)."""
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    first = time.perf_counter() - t0
    if device != "cuda":           # the CPU dry run: the first call is the measurement
        return first * 1e3, first * 1e3, 1, first
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    a, b = ev(), ev()
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    reps = int(min(max_reps, max(min_reps, budget_ms / max(a.elapsed_time(b), 1e-3))))
    marks = [(ev(), ev()) for _ in range(reps)]
    for start, end in marks:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in marks]
    return statistics.median(times), min(times), reps, first


def step(fn: Callable, q, k, v, dout, mode: str) -> Callable[[], object]:
    """One timed call: the forward (inputs require grad, as in training), or forward + backward."""
    if mode == "fwd":
        return lambda: fn(q, k, v)

    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(dout)
    return fwd_bwd


def time_method(rec, method: str, case: Case, n: int, modes: List[str], budget_ms: float = 400.0) -> dict:
    """Times ``method`` in each mode and writes one row per mode; returns ``{mode: ms}`` of the
    modes measured. An unavailable method, an out-of-memory and an error are rows too."""
    got = {}
    try:
        fn = build(method, case, n)
        q, k, v, dout = inputs(case, n)
        for mode in modes:
            try:
                med, low, reps, first = time_ms(step(fn, q, k, v, dout, mode), case.device, budget_ms)
            except RuntimeError as e:
                if "no backward on CPU" not in str(e):
                    raise
                rec.row(method, "skipped", n=n, mode=mode, detail=str(e).splitlines()[0])
                continue
            got[mode] = med
            rec.row(method, "ok", med, "ms", n=n, mode=mode,
                    detail=f"median of {reps} (min {low:.4g} ms); first call {first:.1f} s")
    except Unavailable as e:
        for mode in modes:
            rec.row(method, "unavailable", n=n, mode=mode, detail=str(e))
    except torch.cuda.OutOfMemoryError as e:
        rec.row(method, "oom", n=n, mode=",".join(m for m in modes if m not in got), detail=str(e).splitlines()[0])
    except Exception as e:  # a competitor failing must not stop the stage, but it must be seen
        traceback.print_exc()
        rec.row(method, "error", n=n, mode=",".join(m for m in modes if m not in got),
                detail=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    finally:
        if case.device == "cuda":
            torch.cuda.empty_cache()
    return got


def rel_error(x, ref) -> float:
    """``max |x - ref| / max |ref|`` (in float64)."""
    ref = ref.detach().double()
    return float((x.detach().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def forward_backward(fn: Callable, q, k, v, dout, dlse=None):
    """``[out, (lse,) dq, dk, dv]`` of ``fn`` (returning out, or (out, lse) when ``dlse`` is given)
    for the loss ``<out, dout> (+ <lse, dlse>)``, on fresh leaf copies of q, k, v."""
    x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    res = fn(*x)
    out, lse = (res, None) if dlse is None else res
    loss = (out.to(dout.dtype) * dout).sum() if lse is None else (out.to(dout.dtype) * dout).sum() + (lse * dlse).sum()
    loss.backward()
    return [out.detach()] + ([] if lse is None else [lse.detach()]) + [t.grad for t in x]

