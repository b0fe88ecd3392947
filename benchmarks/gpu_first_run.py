"""The stages of the first GPU run (``bash benchmarks/gpu_first_run.sh``), one subcommand each:

* ``warm``   compiles, in parallel processes, every kernel the next three stages launch (the
             Triton kernels of positional LSH and of the window op, FlexAttention's kernels at
             each shape) into the on-disk caches (Triton's, inductor's), so later stages load them;
* ``check``  bf16, n = 4096, 16 ALiBi heads, d = 128, s = 10, causal: forward + backward of
             ``backend="triton"`` and of ``backend="flex"`` (the independent cross-check, with the
             lse and its gradient) against the float64 oracle, judged against SDPA's own error at
             the same dtype with the same bias; the window op likewise; triton's determinism;
* ``times``  at ``--n`` (131072, 32768): poslsh triton, the 10-sigma window on FlexAttention and on
             Triton, exact ALiBi on FlexAttention, SDPA flash without bias; fwd and fwd+bwd; the
             targets as soon as their operands are measured; first a check of the last 64 rows;
* ``tests``  ``pytest -m gpu`` in parallel shards (``gpu_pytest_rows.py``): every compile of the
             test suite happens in parallel, one row per test with what it printed.

Every result is a row in ``<out>/results.md`` and ``results.csv`` the moment it is measured
(:mod:`gpu_rows`). ``--dry-run`` runs the same code on the CPU: Triton's interpreter, float32,
tiny sizes, FlexAttention forward only. Exit status 1 when a check fails or a row is an error.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import multiprocessing as mp
import os
import subprocess
import sys
import time

import torch

from gpu_common import (Case, Unavailable, build, can_run, dry_case, forward_backward, inputs, partitions,  # noqa: E402
                        rel_error, synchronize, time_method, window_of)
from gpu_rows import Recorder  # noqa: E402
import poslsh  # noqa: E402

N_CHECK, N_MID, N_LONG = 4096, 32768, 131072
DRY_N = {N_CHECK: 97, N_MID: 48, N_LONG: 64}
TIMED = ["poslsh-triton", "window-flex", "exact-flex", "window-triton", "sdpa-flash"]
MODES = ["fwd", "fwd+bwd"]
# (what, numerator, denominator, comparison, bound): at n = 131072, fwd+bwd, the first run's targets
TARGETS = [("exact ALiBi (flex) / poslsh-triton", "exact-flex", "poslsh-triton", ">=", 60.0),
           ("poslsh-triton / 10-sigma window (flex)", "poslsh-triton", "window-flex", "<=", 0.8),
           ("exact ALiBi (flex) / window-triton", "exact-flex", "window-triton", ">=", 100.0),
           ("window-triton / 10-sigma window (flex)", "window-triton", "window-flex", "<", 1.0)]


def _case(args) -> Case:
    return dry_case(Case()) if args.dry_run else Case()


def _n(args, n: int) -> int:
    return DRY_N.get(n, 96) if args.dry_run else n


# ------------------------------------------------------------------ warm
def _warm_jobs(dry: bool):
    """(method, lengths): one process each; the flex window compiles once per length (static shapes)."""
    jobs = [("poslsh-triton", (N_CHECK, N_MID, N_LONG)), ("window-triton", (N_CHECK, N_MID, N_LONG)),
            ("poslsh-flex", (N_CHECK,))]
    if dry:                  # the interpreter compiles nothing: each method once, at the first length
        return [(m, ns[:1]) for m, ns in jobs] + [("window-flex", (N_CHECK,))]
    return jobs + [("window-flex", (n,)) for n in (N_LONG, N_MID, N_CHECK)]


def _warm_one(job) -> tuple:
    """Runs a job's method once per length exactly as the later stages will (same shapes, dtypes,
    grad mode, lse or not), which compiles it into the caches. Returns ``(job, seconds, detail)``."""
    method, ns, dry = job
    t0 = time.time()
    case = dry_case(Case()) if dry else Case()
    done = []
    try:
        for n in ns:
            n = DRY_N.get(n, n) if dry else n
            q, k, v, dout = inputs(case, n)
            if method == "poslsh-flex":
                parts = partitions(case)
                fn = lambda q, k, v: poslsh.poslsh_attention(q, k, v, parts, causal=case.causal,  # noqa: E731
                                                             backend="flex", return_lse=True)
                dlse = torch.randn(case.B, case.H, n, device=case.device)
            else:
                fn, dlse = build(method, case, n), None
            if case.device == "cpu" and "flex" in method:     # no CPU backward: the forward is all there is
                fn(q, k, v)
            else:
                forward_backward(fn, q, k, v, dout, dlse)
            synchronize(case.device)
            done.append(str(n))
        if method == "poslsh-triton" and can_run("triton", "sequence", q, {"lse"}) is None:   # check's lse variant
            n = DRY_N[N_CHECK] if dry else N_CHECK
            q, k, v, dout = inputs(case, n)
            parts = partitions(case)
            forward_backward(lambda q, k, v: poslsh.poslsh_attention(q, k, v, parts, causal=case.causal,
                                                                     backend="triton", return_lse=True),
                             q, k, v, dout, torch.randn(case.B, case.H, n, device=case.device))
            done.append(f"{n} with lse")
    except Unavailable as e:
        return method, time.time() - t0, f"unavailable: {e}"
    except Exception as e:  # reported by the parent; the later stages compile what is missing
        return method, time.time() - t0, f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return method, time.time() - t0, f"ok: n = {', '.join(done)}"


def warm(args) -> int:
    rec = Recorder(args.out, args.stage)
    jobs = [(*j, args.dry_run) for j in _warm_jobs(args.dry_run)]
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        for method, secs, detail in pool.imap_unordered(_warm_one, jobs):
            result = detail.split(":")[0]
            rec.row(f"compile {method}", result, secs, "s", detail=detail.partition(": ")[2])
    rec.row("warm-up", "info", time.time() - t0, "s", detail=f"{len(jobs)} jobs in parallel processes")
    return 1 if rec.failures else 0


# ------------------------------------------------------------------ check
def _versions() -> str:
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "missing"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{gpu}; torch {torch.__version__}, triton {tv}, python {sys.version.split()[0]}"


def _judge(rec, item, names, got, ref, bounds, n, sdpa=None):
    """One row per quantity: PASS when the error is within its bound."""
    mode = "fwd+bwd" if any(name.startswith("d") for name in names) else "fwd"
    for name, x, r, bound in zip(names, got, ref, bounds):
        e = rel_error(x, r)
        vs = f"; SDPA {sdpa[name]:.2e}" if sdpa and name in sdpa else ""
        rec.row(f"{item} {name}", "PASS" if e <= bound else "FAIL", e, "rel err", n=n, mode=mode,
                detail=f"max|x - ref| / max|ref| vs the float64 oracle, bound {bound:.1e}{vs}")


def _sdpa_errors(case, q, k, v, dout, bias, ref, n):
    """SDPA's own error at the case's dtype with the same additive bias (dense), vs the oracle."""
    bias = bias.to(case.torch_dtype)[None]
    gqa = case.H != case.Hkv
    fn = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias,  # noqa: E731
                                                                         enable_gqa=gqa)
    got = forward_backward(fn, q, k, v, dout)
    return {name: rel_error(x, r) for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref)}


def _bound(case, sdpa_err: float) -> float:
    """Flash-attention's criterion: within 3x PyTorch's own error at the same dtype (float32: 2e-5)."""
    return 2e-5 if case.dtype == "float32" else 3 * sdpa_err + 1e-6


def _try(rec, item, n, fn):
    try:
        return fn()
    except Unavailable as e:
        rec.row(item, "unavailable", n=n, detail=str(e))
    except Exception as e:  # recorded, the stage goes on
        import traceback
        traceback.print_exc()
        rec.row(item, "error", n=n, detail=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    return None


def check(args) -> int:
    case, n = _case(args), _n(args, N_CHECK)
    rec = Recorder(args.out, args.stage)
    rec.row("config", "info", detail=f"{case.describe()}; {_versions()}")
    parts = partitions(case)
    q, k, v, dout = inputs(case, n, grad=False)
    g = torch.Generator(device=case.device).manual_seed(7)
    dlse = torch.randn(case.B, case.H, n, generator=g, device=case.device)
    xd = [t.double() for t in (q, k, v)]
    t0 = time.time()
    oracle = lambda q, k, v: poslsh.poslsh_attention_reference(q, k, v, parts, causal=case.causal,  # noqa: E731
                                                               return_lse=True)
    ref = forward_backward(oracle, *xd, dout.double(), dlse.double())            # out, lse, dq, dk, dv
    later = torch.ones(n, n, dtype=torch.bool, device=case.device).triu(1) & case.causal    # masked by causality
    ref_plain = forward_backward(lambda q, k, v: oracle(q, k, v)[0], *xd, dout.double())
    sdpa = _sdpa_errors(case, q, k, v, dout, parts.dense_count(n).double().log().masked_fill(later, float("-inf")),
                        ref_plain, n)
    rec.row("float64 oracle + SDPA at the same dtype", "info", time.time() - t0, "s", n=n,
            detail="SDPA errors: " + ", ".join(f"{k_} {e:.2e}" for k_, e in sdpa.items()))
    names = ("out", "dq", "dk", "dv")
    bounds = [_bound(case, sdpa[k_]) for k_ in names]
    lse_bound = 2e-5 if case.dtype == "float32" else 1e-2

    tri = _try(rec, "poslsh-triton", n, lambda: forward_backward(build("poslsh-triton", case, n, parts), q, k, v, dout))
    if tri is not None:
        _judge(rec, "poslsh-triton", names, tri, ref_plain, bounds, n, sdpa)
        again = forward_backward(build("poslsh-triton", case, n, parts), q, k, v, dout)
        same = all(torch.equal(a, b) for a, b in zip(tri, again))
        rec.row("poslsh-triton deterministic (two runs bitwise equal)", "PASS" if same else "FAIL", n=n)

    def flex_lse():
        if can_run("flex", "sequence", q, {"lse"}):
            raise Unavailable(can_run("flex", "sequence", q, {"lse"}))
        fn = lambda q, k, v: poslsh.poslsh_attention(q, k, v, parts, causal=case.causal, backend="flex",  # noqa: E731
                                                     return_lse=True)
        if case.device == "cpu":        # forward only on the CPU
            with torch.no_grad():
                return list(fn(q, k, v))
        return forward_backward(fn, q, k, v, dout, dlse)
    fl = _try(rec, "poslsh-flex", n, flex_lse)
    if fl is not None:
        fl_names = ("out", "lse", "dq", "dk", "dv")[:len(fl)]
        _judge(rec, "poslsh-flex", fl_names, fl, ref, [bounds[0], lse_bound] + bounds[1:], n, sdpa)
        if tri is not None:
            rec.row("poslsh-flex vs poslsh-triton out", "info", rel_error(fl[0], tri[0]), "rel diff", n=n)
    del ref, ref_plain

    # the window op: ALiBi cut at 10 sigma per head
    slopes, window = window_of(case, n, "window-flex")
    wref = forward_backward(lambda q, k, v: poslsh.reference.alibi_attention_reference(
        q, k, v, slopes, window=window, causal=case.causal), *xd, dout.double())
    dist = (torch.arange(n, device=case.device)[:, None] - torch.arange(n, device=case.device)[None]).abs()
    wbias = -slopes.to(case.device)[:, None, None] * dist
    wbias = wbias.masked_fill((dist > window.to(case.device)[:, None, None]) | later, float("-inf"))
    wsdpa = _sdpa_errors(case, q, k, v, dout, wbias, wref, n)
    del wbias, dist, later
    wbounds = [_bound(case, wsdpa[k_]) for k_ in names]
    for method in ("window-triton", "window-flex"):
        def run(method=method):
            fn = build(method, case, n)
            if case.device == "cpu" and method == "window-flex":
                with torch.no_grad():
                    return [fn(q, k, v)]
            return forward_backward(fn, q, k, v, dout)
        got = _try(rec, method, n, run)
        if got is not None:
            _judge(rec, method, names[:len(got)], got, wref, wbounds, n, wsdpa)

    # the lse of the fused kernel, where it has one
    def triton_lse():
        why = can_run("triton", "sequence", q, {"lse"})
        if why:
            raise Unavailable(why)
        fn = lambda q, k, v: poslsh.poslsh_attention(q, k, v, parts, causal=case.causal, backend="triton",  # noqa: E731
                                                     return_lse=True)
        return forward_backward(fn, q, k, v, dout, dlse)
    tl = _try(rec, "poslsh-triton return_lse", n, triton_lse)
    if tl is not None:
        ref = forward_backward(oracle, *xd, dout.double(), dlse.double())
        _judge(rec, "poslsh-triton (with lse)", ("out", "lse", "dq", "dk", "dv"), tl, ref,
               [bounds[0], lse_bound] + bounds[1:], n, sdpa)
    return 1 if rec.failures else 0


# ------------------------------------------------------------------ times
def _rows_check(rec, case, n):
    """The last 64 rows of poslsh-triton at length n against a dense float64 evaluation of those
    rows (keys from the first key any of them can see), built on the device."""
    parts = partitions(case)
    q, k, v, _ = inputs(case, n, grad=False)
    with torch.no_grad():
        out = build("poslsh-triton", case, n, parts)(q, k, v)
    r0 = max(0, n - 64)
    lo = int(parts.block_bounds(n, torch.arange(r0, n, device=case.device))[0].min())
    ref = poslsh.poslsh_attention_reference(q[:, :, r0:].double(), k[:, :, lo:].double(), v[:, :, lo:].double(),
                                            parts, causal=True, q_start=r0, k_start=lo)
    e = rel_error(out[:, :, r0:], ref)
    bound = 2e-5 if case.dtype == "float32" else 1e-2
    ok = e <= bound and bool(torch.isfinite(out).all())
    rec.row("poslsh-triton last 64 rows vs float64", "PASS" if ok else "FAIL", e, "rel err", n=n, mode="fwd",
            detail=f"keys [{lo}, {n}), bound {bound:.0e}, all outputs finite: {bool(torch.isfinite(out).all())}")


def _targets(rec, measured, n, full, done):
    for what, num, den, op, bound in TARGETS:
        for mode in MODES:
            a, b = measured.get(num, {}).get(mode), measured.get(den, {}).get(mode)
            if a is None or b is None or (what, mode) in done:
                continue
            done.add((what, mode))
            ratio = a / b
            judged = full and n == N_LONG and mode == "fwd+bwd"
            ok = {">=": ratio >= bound, "<=": ratio <= bound, "<": ratio < bound}[op]
            rec.row(f"target: {what}", ("PASS" if ok else "FAIL") if judged else "info", ratio, "x", n=n, mode=mode,
                    detail=f"target {op} {bound:g} at n = {N_LONG}, fwd+bwd" + ("" if judged else " (not judged here)"),
                    fatal=False)          # a missed target is a measurement, not a failure of the stage


def times(args) -> int:
    case, n = _case(args), _n(args, args.n)
    rec = Recorder(args.out, args.stage)
    rec.row("config", "info", n=n, detail=case.describe())
    probe = torch.zeros(1, 1, 1, case.d, device=case.device, dtype=case.torch_dtype)
    if case.causal and can_run("triton", "sequence", probe) is None:
        _try(rec, "poslsh-triton rows check", n, lambda: _rows_check(rec, case, n))
    measured, done = {}, set()
    for method in TIMED:
        measured[method] = time_method(rec, method, case, n, MODES)
        _targets(rec, measured, n, not args.dry_run, done)
    return 1 if rec.failures else 0


# ------------------------------------------------------------------ tests
def gpu_test_files():
    """The test files with GPU-marked tests (whoever added them)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = sorted(glob.glob(os.path.join(root, "tests", "**", "test_*.py"), recursive=True))
    return [os.path.relpath(f, root) for f in files if "mark.gpu" in open(f).read()]


def tests(args) -> int:
    rec = Recorder(args.out, args.stage)
    if importlib.util.find_spec("pytest") is None:      # a device image without it cannot get it (no pip)
        rec.row("pytest -m gpu", "skipped", detail="pytest is not installed on this machine: the GPU tests need "
                "it; the check stage above is the correctness check of this run")
        return 0
    files = gpu_test_files()
    shards = max(1, min(args.shards or (os.cpu_count() or 1) - 2, 12))
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    procs = []
    for i in range(shards):
        os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
        log = open(os.path.join(args.out, "logs", f"tests-shard{i}.log"), "w")
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-rA", "--tb=short", "-p", "no:cacheprovider",
               "-p", "gpu_pytest_rows", f"--shard={i}/{shards}", f"--rows-out={args.out}",
               f"--rows-stage={args.stage}", *files]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    t0 = time.time()
    codes = []
    for p, log in procs:
        codes.append(p.wait())
        log.close()
    bad = [i for i, c in enumerate(codes) if c not in (0, 5)]     # 5: the shard got no test
    rec.row("pytest -m gpu", "ok" if not bad else "failed", time.time() - t0, "s",
            detail=f"{shards} parallel shards over {', '.join(files)}; exit codes {codes}")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["warm", "check", "times", "tests"])
    p.add_argument("--out", required=True, help="folder of results.md / results.csv")
    p.add_argument("--stage", default=None, help="the stage name in the rows (default: the subcommand)")
    p.add_argument("--dry-run", action="store_true", help="CPU: Triton interpreter, float32, tiny sizes")
    p.add_argument("--n", type=int, default=N_LONG, help="times: the sequence length")
    p.add_argument("--shards", type=int, default=0, help="tests: parallel pytest processes (default cores - 2, <= 12)")
    args = p.parse_args(argv)
    args.stage = args.stage or args.what
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_first_run: no CUDA GPU here; use --dry-run for the CPU code path", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False      # the oracles are float64; nothing relies on tf32
    return {"warm": warm, "check": check, "times": times, "tests": tests}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
