"""Static checks of the Triton backend that need no GPU.

Three sections (all by default; pick with --compile / --launches / --designs):

* ``--compile``: every kernel configuration (``poslsh.ops.triton._config``: forward,
  dk/dv, dq; bf16 and fp32; d = 128 unless ``--head-dim``) compiled for sm_90
  (``GPUTarget("cuda", 90, 32)``) with the installed triton and its ``ptxas``:
  registers, spill stores/loads, shared memory, compile seconds, next to the
  shared-memory model that prunes configurations before compiling and the verdict
  of that pruning for a 227 KiB Hopper SM. Also the plan kernel.
* ``--launches``: the kernel launches of one forward + backward (the plan kernel is
  built once and then cached), counted on CPU under the interpreter.
* ``--designs``: the count-design cost model on the plan's tile arithmetic (16 ALiBi
  heads, s = 10, n = 131072 by default): visited tiles, the per-element work of label
  compares vs the one-hot MMA (see docs/triton.md).

Run: ``python benchmarks/triton_static.py [--compile] [--launches] [--designs] [--quick]``.
Exit status 1 if a configuration that pruning keeps fails to compile, spills more than
``--max-spill`` bytes, or needs more shared memory than the model says.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

PTR = {"Q", "K", "V", "Out", "DO", "DK", "DVt", "DQ"}
I32_PTR = {"IDS", "GRAN", "ORDER", "LAT", "KSZ", "WIN", "START", "END"}
F32_PTR = {"LSE", "LSE_LO", "DELTA", "DLSE", "SLOPE"}
FLOATS = {"qk_scale", "sm_scale"}


def compile_sm90(fn, types: dict, consts: dict, warps: int, stages: int, aligned=()) -> dict:
    """Compile ``fn`` for sm_90 without a GPU; returns regs, spills, smem (bytes), seconds."""
    import triton
    from triton.backends.compiler import GPUTarget

    sig, cx = {}, {}
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            sig[name], cx[name] = "constexpr", consts[name]
        else:
            sig[name] = types[name]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned if a in fn.arg_names}
    src = triton.compiler.ASTSource(fn, sig, cx, attrs)
    buf = io.StringIO()
    old_log, old_dir = triton.knobs.nvidia.dump_ptxas_log, triton.knobs.cache.dir
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:       # fresh cache: ptxas always runs and logs
        triton.knobs.nvidia.dump_ptxas_log, triton.knobs.cache.dir = True, d
        try:
            with contextlib.redirect_stdout(buf):
                k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=warps, num_stages=stages))
        finally:
            triton.knobs.nvidia.dump_ptxas_log, triton.knobs.cache.dir = old_log, old_dir
    log = buf.getvalue()
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(regs=regs, spill_st=int(sp.group(1)), spill_ld=int(sp.group(2)), smem=int(k.metadata.shared),
                secs=time.time() - t0)


def _types(fn, dt: str) -> dict:
    out = {}
    for a in fn.arg_names:
        if a in PTR:
            out[a] = "*" + dt
        elif a in I32_PTR:
            out[a] = "*i32"
        elif a in F32_PTR:
            out[a] = "*fp32"
        elif a in FLOATS:
            out[a] = "fp32"
        elif a in ("W", "C"):
            out[a] = "*fp64"
        else:
            out[a] = "i32"
    return out


def _aligned(fn):
    # what the JIT specialises for 16-byte aligned tensors and strides that are multiples of 16
    return [a for a in fn.arg_names if a in PTR | I32_PTR | F32_PTR or (a.startswith("s") and a[-1] in "hn"
                                                                      and a not in ("sm_scale",))]


def section_compile(args) -> bool:
    import triton
    from poslsh.ops.triton import _config, _launch

    mod = _launch.kernels(False)
    # every configuration list: "fwd" (one-hot launches, PATH 1), "fwd/compare" (PATH 2), "wfwd" (window), ...
    fns = {name: getattr(mod, _launch.KERNEL_FNS[name.split("/")[0]]) for name in _config.CONFIGS}
    limit = _config.DEFAULT_SMEM
    ok = True
    d = args.head_dim
    print(f"\n== compile for sm_90 (triton {triton.__version__}): d = {d}, causal, TMA loads, any s "
          f"(runtime sample loop), R_MAX = {_config.R_MAX}; smem limit {limit // 1024} KiB ==")
    print("path 1: one-hot count programs, path 2: label-compare programs (two launches); path 0: one kernel with "
          "both; L: grouped partitions (lattice counts); w*: the window op's kernels (wD: packed documents)")
    print(f"{'kernel':>6} {'dtype':>5} {'BM x BN/warps/stages':>32} {'path':>4} {'regs':>5} {'spill st/ld (B)':>16} "
          f"{'smem KiB':>9} {'model KiB':>9} {'pruned':>7} {'compile s':>9}")
    dtypes = ["bf16"] if args.quick else ["bf16", "fp32"]
    # "2L": the label-compare path for grouped partitions (lattice counts, LATTICE=True)
    paths = [(int(x.rstrip("L")), x.endswith("L")) for x in args.paths.split(",")]
    for dt in dtypes:
        for name, fn in fns.items():
            configs = _config.CONFIGS[name][:1] if args.quick else _config.CONFIGS[name] + [_config.FALLBACK[name]]
            for c in configs:
                fallback = c is _config.FALLBACK[name]
                bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
                est = _config.smem_estimate(name, bm, bn, c.num_stages, d, d, 4 if dt == "fp32" else 2)
                pruned = est > limit and not fallback
                cfg = f"{bm}x{bn}/{c.num_warps}/{c.num_stages}" + (" (fallback)" if fallback else "")
                if pruned and not args.all:
                    print(f"{name:>6} {dt:>5} {cfg:>32} {'-':>4} {'-':>5} {'-':>16} {'-':>9} {est / 1024:>9.0f} "
                          f"{'yes':>7} {'-':>9}", flush=True)
                    continue
                window = name.startswith("w")
                mine = [(p, lat) for p, lat in paths if (p == 2) == name.endswith("/compare")]
                for path, lattice in ([("w", False), ("w", True)] if window else mine):
                    consts = dict(CAUSAL=True, D=d, DV=d, HEAD_DIM=d, HEAD_DV=d, USE_TMA=True, BLOCK_M=bm, BLOCK_N=bn,
                                  DOT_PREC="tf32x3" if dt == "fp32" else "tf32")
                    if window:      # lattice stands for packed documents here
                        consts.update(HAS_DOCS=lattice)
                        label = "wD" if lattice else "w"
                    else:
                        consts.update(R_MAX=_config.R_MAX, SC=_config.SAMPLE_CHUNK, PATH=path, LATTICE=lattice,
                                      CLASS_TILE=_config.CLASS_TILE[_config.KIND[name]], ROW_PLANS=False)
                        label = f"{path}{'L' if lattice else ''}"
                    try:
                        r = compile_sm90(fn, _types(fn, dt), consts, c.num_warps, c.num_stages, _aligned(fn))
                    except Exception as e:  # noqa: BLE001 - reported, and a failure
                        print(f"{name:>6} {dt:>5} {cfg:>32} {label:>4} FAILED: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120]}", flush=True)
                        ok = ok and pruned
                        continue
                    # kept configurations must fit the model (fallbacks: the SM); 16-bit ones must not spill much
                    bad = (not pruned) and (r["smem"] > (limit if fallback else est)
                                            or (path != 0 and dt != "fp32" and r["spill_st"] > args.max_spill))
                    ok = ok and not bad
                    print(f"{name:>6} {dt:>5} {cfg:>32} {label:>4} {r['regs']:>5} {r['spill_st']:>7}/{r['spill_ld']:<8} "
                          f"{r['smem'] / 1024:>9.1f} {est / 1024:>9.0f} {'yes' if pruned else 'no':>7} "
                          f"{r['secs']:>9.1f}{'  <-- check' if bad else ''}", flush=True)
    fn = mod._plan_kernel
    r = compile_sm90(fn, _types(fn, "fp32"), dict(BLOCK=_launch.PLAN_BLOCK, H_PAD=16), 4, 1, ["IDS", "GRAN"])
    print(f"{'plan':>6} {'f64':>5} {'BLOCK=1024/4':>32} {'':>4} {r['regs']:>5} {r['spill_st']:>7}/{r['spill_ld']:<8} "
          f"{r['smem'] / 1024:>9.1f} {'':>9} {'':>7} {r['secs']:>9.1f}")
    print("compile check:", "PASS" if ok else "FAIL (see <-- check)")
    return ok


def section_launches(args) -> None:
    # triton is imported before the interpreter is requested: triton decorates its own helpers
    # (tl.max, ...) for one mode when it is first imported, and the compile section needs them
    # compiled. The variable is only needed while the CPU tensors run (why_not), and is restored.
    from torch.utils._python_dispatch import TorchDispatchMode

    import poslsh
    from poslsh.ops.triton import _launch, _plan
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        _count_launches(args, poslsh, _launch, _plan, TorchDispatchMode)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _count_launches(args, poslsh, _launch, _plan, TorchDispatchMode) -> None:
    class _Ops(TorchDispatchMode):        # aten ops that launch a kernel on a GPU (no views / allocations)
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if not any(x in name for x in ("view", "empty", "detach", "unsqueeze", "expand", "slice", "select",
                                           "alias", "as_strided", "lift_fresh", "unbind", "squeeze")):
                self.count += 1
            return func(*args, **(kwargs or {}))

    print("\n== kernel launches ==")
    H, S, n = args.heads, args.samples, 8192
    parts = poslsh.sample_partitions(poslsh.alibi_sigmas(H), S, seed=0)
    with _Ops() as ops:
        _plan.granule_bounds(parts.widths, parts.offsets, n)
        _plan.head_order(parts.widths, n, 1)
    print(f"  before: the plan as torch ops (granule bounds + head order, n = {n}) + one labels kernel: "
          f"{ops.count + 1} launches, in every forward and again in every backward")
    torch.manual_seed(0)
    small = poslsh.sample_partitions(poslsh.alibi_sigmas(4), S, seed=0)
    q, k, v = (torch.randn(1, 4, 64, 16, requires_grad=True) for _ in range(3))
    _plan.CACHE.clear()
    for split in (False, True):
        _launch.SPLIT = split
        for step in (1, 2):
            _launch.LAUNCHES.clear()
            with _Ops() as ops:
                out = poslsh.poslsh_attention(q, k, v, small, causal=True, backend="triton")
                out.sum().backward()
            total = sum(_launch.LAUNCHES.values())
            print(f"  {'two launches per kernel (GPU default)' if split else 'one launch per kernel':>38}, "
                  f"call {step}: triton {dict(_launch.LAUNCHES)} = {total}; plan launches {_launch.LAUNCHES['plan']}"
                  )
        _plan.CACHE.clear()
    _launch.SPLIT = None


# Cost model of the count designs, in "MMA-eq": the time of one [P x T x 128] bf16 tensor-core
# product (QK^T of a tile pair at d = 128). An H100/H200 SM does 2048 bf16 MACs per clock and
# 128 fp32 ALU lanes (64 int32), and exp2 runs on 16 MUFU lanes, so per score element: one ALU op
# = 1/8 MMA-eq (int compares ~2x: ignored, which favours label compares), one exp2 = 1 MMA-eq.
ALU = 1 / 8
MASK_OPS = 3          # count > 0 test, p * count, causal compare (every design)


def tile_costs(widths, offsets, n: int, P: int, T: int, causal: bool, transpose: bool, r_max=(16, 32, 64)):
    """Per head: visited (program tile, streamed tile) pairs and the count cost of each design.

    * ``D0`` (before): per-sample classification from the tile corners; a sample with block
      boundaries inside both tiles costs 2 ops per element (compare + add), +2 ops to combine.
    * ``OH<r>`` (after, R_MAX = r): programs whose tile meets <= r (sample, block) pairs: one
      fp16 MMA with K = r and the [r, T] one-hot of the streamed tile (4 ops per entry); the
      other programs: label compares, 2 ops per element per sample.
    """
    from poslsh.ops.triton import _plan
    from poslsh.partitions import block_labels

    lo, hi, R = _plan.tile_ranges(widths, offsets, n, P, causal, transpose)
    nt = (torch.clamp(hi - lo, min=0) + T - 1) // T
    H, S = widths.shape
    J = int(nt.max())
    p0 = torch.arange(0, n, P)
    pl = torch.clamp(p0 + P, max=n) - 1
    base = 2 + 1 + 6 * ALU                       # QK^T + PV, exp2, ~6 softmax ALU ops
    rows = []
    for h in range(H):
        lab = block_labels(widths[h:h + 1], offsets[h:h + 1], torch.arange(n, dtype=torch.float64))[0].long()
        j = torch.arange(J)
        t0 = lo[h][:, None] + j[None] * T
        valid = j[None] < nt[h][:, None]
        t1 = torch.clamp(t0 + T, max=n) - 1
        b0, b1 = lab[:, t0.clamp(0, n - 1)], lab[:, t1.clamp(0, n - 1)]           # [S, nP, J]
        a0, a1 = lab[:, p0][..., None], lab[:, pl][..., None]
        meet = (a1 >= b0) & (b1 >= a0) & valid[None]
        both = (meet & (a0 != a1) & (b0 != b1)).sum(0).double()                   # doubly-cut samples
        tiles = int(valid.sum())
        d0 = ((2 * both + 2 + MASK_OPS) * ALU)[valid]
        cmp = torch.full_like(d0, (2 * S + MASK_OPS) * ALU)
        row = dict(h=h, tiles=tiles, both=float(both[valid].mean()) if tiles else 0.0, base=base * tiles,
                   D0=float(d0.sum()), R=float(R[h].double().mean()), alu_D0=float(d0.sum()) / ALU)
        Rv = R[h][:, None].expand_as(valid)[valid]
        for r in r_max:
            oh = r / 128 + 4 * r / P * ALU + MASK_OPS * ALU
            use = Rv <= r
            row[f"OH{r}"] = float(torch.where(use, torch.full_like(d0, oh), cmp).sum())
            row[f"OH{r}_tiles"] = int(use.sum())
            row[f"alu_OH{r}"] = float(torch.where(use, torch.full_like(d0, 4 * r / P + MASK_OPS), cmp / ALU).sum())
            row[f"alu_D0_on_OH{r}"] = float((d0 / ALU)[use].sum())
        rows.append(row)
    return rows


def section_designs(args) -> None:
    import poslsh

    H, S, n = args.heads, args.samples, args.n
    sig = poslsh.alibi_sigmas(H)
    parts = poslsh.sample_partitions(sig, S, seed=0)
    print(f"\n== count designs: {H} ALiBi heads, s = {S}, n = {n}, causal; cost in MMA-eq (see ALU above) ==")
    variants = [("fwd / dq", 128, 64, False), ("dk/dv", 64, 32, True)]
    if not args.quick:
        variants += [("fwd / dq", 128, 32, False), ("fwd / dq", 64, 64, False), ("dk/dv", 64, 64, True)]
    for kind, P, T, tr in variants:
        t0 = time.time()
        rows = tile_costs(parts.widths, parts.offsets, n, P, T, True, tr)
        tot = {k: sum(r[k] for r in rows) for k in rows[0] if k != "h"}
        print(f"\n{kind}: program tile {P}, streamed tile {T}: {tot['tiles']} tile pairs "
              f"({tot['tiles'] * P * T / 1e6:.0f}M scores), doubly-cut samples per pair "
              f"{sum(r['both'] * r['tiles'] for r in rows) / tot['tiles']:.2f}  [{time.time() - t0:.0f} s]")
        print(f"  {'head':>4} {'sigma':>6} {'pairs':>6} {'cut/pair':>8} {'R mean':>7} {'D0':>6} {'OH32':>6} "
              f"{'OH64':>6}   (count cost per pair, MMA-eq; base per pair {rows[0]['base'] / max(rows[0]['tiles'], 1):.2f})")
        for r in rows:
            t = max(r["tiles"], 1)
            print(f"  {r['h']:>4} {float(sig[r['h']]):>6.1f} {r['tiles']:>6} {r['both']:>8.2f} {r['R']:>7.1f} "
                  f"{r['D0'] / t:>6.2f} {r['OH32'] / t:>6.2f} {r['OH64'] / t:>6.2f}")
        b = tot["base"]
        line = f"  total: base {b:.0f}; count D0 {tot['D0']:.0f} ({tot['D0'] / b:.0%} of base)"
        for r in (16, 32, 64):
            line += (f", OH{r} {tot[f'OH{r}']:.0f} ({tot[f'OH{r}'] / b:.0%}; one-hot on "
                     f"{tot[f'OH{r}_tiles'] / tot['tiles']:.0%} of pairs)")
        print(line)
        o = tot["OH32_tiles"]
        print(f"  ALU ops of the count per visited score element (tensor-core work apart): D0 "
              f"{tot['alu_D0'] / tot['tiles']:.1f}, OH32 {tot['alu_OH32'] / tot['tiles']:.1f}; on the pairs OH32 "
              f"counts by one-hot: D0 {tot['alu_D0_on_OH32'] / max(o, 1):.1f} -> OH32 {4 * 32 / P + MASK_OPS:.1f}")


def section_narrow(args) -> None:
    """Score elements the label-compare launch visits (its class tiles: R > R_MAX on 128 query rows)
    with the tiles it may use: the count costs ~2 s ALU ops per score there, so the count's work
    falls with the visited scores."""
    import poslsh
    from poslsh.ops.triton import _config, _plan

    H, S, n = args.heads, args.samples, args.n
    sig = poslsh.alibi_sigmas(H)
    parts = poslsh.sample_partitions(sig, S, seed=0)
    C = _config.CLASS_TILE["fwd"]
    _, _, Rc = _plan.tile_ranges(parts.widths, parts.offsets, n, C, True)
    compare = Rc > _config.R_MAX
    print(f"\n== label-compare launch (narrow heads): {H} ALiBi heads, s = {S}, n = {n}, causal ==")
    print("  share of class tiles on the compare launch per head (sigma: share): "
          + ", ".join(f"{float(sig[h]):.0f}: {float(compare[h].float().mean()):.2f}" for h in range(H)))
    base = None
    for P, T in [(128, 64), (128, 32), (64, 64), (64, 32), (32, 32)]:
        lo, hi, _ = _plan.tile_ranges(parts.widths, parts.offsets, n, P, True)
        nt = (torch.clamp(hi - lo, min=0) + T - 1) // T
        mine = compare.repeat_interleave(C // P, dim=1)[:, :nt.shape[1]]
        scores = float((nt * mine).sum()) * P * T
        base = base or scores
        print(f"  forward / dq tiles {P:>3} x {T:<3}: {scores / 1e6:6.0f}M scores visited ({scores / base:.2f}x of 128 x 64)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--launches", action="store_true")
    p.add_argument("--designs", action="store_true")
    p.add_argument("--quick", action="store_true", help="bf16 only; fewer design variants")
    p.add_argument("--all", action="store_true", help="also compile the configurations pruning drops")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--max-spill", type=int, default=1024, help="spill stores (bytes) above which a kept config fails")
    p.add_argument("--n", type=int, default=131072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--paths", default="1,2,2L", help="PATH values to compile (0: both counts in one kernel; a "
                   "trailing L: with lattice counts, as for grouped partitions)")
    args = p.parse_args(argv)
    if not (args.compile or args.launches or args.designs):
        args.compile = args.launches = args.designs = True
    ok = True
    if args.launches:
        section_launches(args)
    if args.designs:
        section_designs(args)
        section_narrow(args)
    if args.compile:
        ok = section_compile(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
