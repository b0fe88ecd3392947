"""Decoding benchmark: per-token time and peak memory at long contexts, side by side.

A tiny Qwen3-style model (the ``cpu`` preset's shape: 4 layers, 8 query / 4 key-value
heads, head_dim 16, hidden 128, vocabulary 4096; float32, batch 1) in three versions:

* ``poslsh-s10``: positional-LSH attention, s = 10, with the bounded
  :class:`poslsh.integrations.hf.cache.PoslshCache`; the context is a real chunked
  prefill (4096 tokens per forward) through that cache;
* ``alibi``: exact ALiBi with transformers' full ``DynamicCache``;
* ``original``: the RoPE model with ``sdpa`` and a full ``DynamicCache``.

For the two full caches a real prefill of 128k tokens is quadratic (hours, and a
``4096 x 128k`` mask per chunk), so their caches are filled with random keys and
values of the right shape: a decoding step costs the same whatever the values.

Each (model, context) runs in a fresh process on ``--threads`` threads: build, fill,
3 warm-up steps, then ``--steps`` timed greedy steps (one token each, ``model(...)``
with the cache). Reported: the median CPU ms per token (``time.process_time``: on a
shared machine wall time mostly measures the other tenants; the wall-clock median is
reported next to it), the peak resident memory of the
process *during decoding* (``VmHWM`` after ``malloc_trim`` and resetting it through
``/proc/self/clear_refs``), and the KV-cache bytes. Every configuration runs
``--rounds`` times, contexts ascending then descending, and the round with the lowest
median is kept (the machine may be shared: the spread over rounds is printed). Then
the ratios: per-token time at 32k / 1k and peak memory 128k / 8k.

Writes ``outputs/bench_decode.json`` (``--out`` to choose). Run:
``python benchmarks/bench_decode.py [--contexts 1024 8192 32768 131072] [--quick]``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_common import machine, write_json

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("poslsh-s10", "alibi", "original")
VOCAB, CHUNK = 4096, 4096


def build(method: str):
    from transformers import Qwen3Config

    from poslsh.integrations import hf

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                      max_position_embeddings=1 << 20, attention_dropout=0.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    if method.startswith("poslsh"):
        model = hf.model_from_config(cfg, "poslsh", num_samples=int(method.split("-s")[1]))
    else:
        model = hf.model_from_config(cfg, method)
    return model.eval()


def fill(model, method: str, context: int):
    """A cache holding ``context`` tokens; returns (cache, seconds)."""
    from transformers import DynamicCache

    from poslsh.integrations import hf

    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(1)
    if method.startswith("poslsh"):
        cache = hf.generation_cache(model)
        with torch.no_grad():
            for lo in range(0, context, CHUNK):
                ids = torch.randint(0, VOCAB, (1, min(CHUNK, context - lo)), generator=g)
                model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    else:
        c = model.config
        cache = DynamicCache(config=c)
        for i in range(c.num_hidden_layers):
            k = torch.randn(1, c.num_key_value_heads, context, c.head_dim, generator=g)
            cache.update(k, torch.randn_like(k), i)
    return cache, time.perf_counter() - t0


def _vm(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def worker(method: str, context: int, steps: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    model = build(method)
    cache, fill_s = fill(model, method, context)
    tok = torch.tensor([[1]])
    times = []
    try:   # give freed heap back to the OS, so the peak below is decoding's, not the fill's leftovers
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")    # peak RSS := current RSS
        reset = True
    except OSError:
        reset = False
    cpu = []
    with torch.no_grad():
        for i in range(3 + steps):
            t, c = time.perf_counter(), time.process_time()
            logits = model(tok, cache=cache, use_cache=True).logits
            tok = logits[:, -1:].argmax(-1)
            if i >= 3:
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
    kv = sum(t.numel() * t.element_size() for l in cache.layers for t in (l.keys, l.values))
    out = {"method": method, "context": context, "ms_per_token": 1e3 * statistics.median(cpu),
           "wall_ms_per_token": 1e3 * statistics.median(times), "wall_ms_spread": [1e3 * min(times), 1e3 * max(times)], "peak_rss_mib": _vm("VmHWM") if reset else None,
           "rss_mib": _vm("VmRSS"), "kv_mib": kv / 2**20, "fill_s": fill_s}
    if method.startswith("poslsh"):
        st = cache.stats()
        out.update(kept=max(s["kept"] for s in st), bound=max(s["bound"] for s in st),
                   peak_keys=max(s["peak"] for s in st))
    return out


def run_one(method: str, context: int, steps: int, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--worker", method, str(context), str(steps), str(threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    if res.returncode != 0:
        return {"method": method, "context": context, "error": res.stderr.strip().splitlines()[-1:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def table(rows, contexts) -> str:
    by = {(r["method"], r["context"]): r for r in rows}
    head = "| model | cache | " + " | ".join(f"{c // 1024}k: CPU ms/token, peak MiB" for c in contexts) + " |"
    lines = [head, "|" + "---|" * (2 + len(contexts))]
    for m in METHODS:
        kind = "bounded (PoslshCache)" if m.startswith("poslsh") else "full (DynamicCache)"
        cells = []
        for c in contexts:
            r = by.get((m, c), {})
            cells.append("error" if "error" in r else f"{fmt(r.get('ms_per_token'))} ms, {fmt(r.get('peak_rss_mib'), '.0f')}")
        lines.append(f"| {m} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        m, c, s, t = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(worker(m, c, s, t)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--steps", type=int, default=48, help="timed decoding steps per configuration")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="runs per configuration (the fastest is kept)")
    ap.add_argument("--quick", action="store_true", help="contexts 1k and 8k, 16 steps")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench_decode.json"))
    a = ap.parse_args()
    contexts, steps = ([1024, 8192], 16) if a.quick else (a.contexts, a.steps)
    print(f"machine: {machine()}; {a.threads} thread(s) per run, {steps} timed steps", flush=True)
    runs = {}
    for rnd in range(a.rounds):
        for c in (contexts if rnd % 2 == 0 else contexts[::-1]):
            for m in a.methods:
                r = run_one(m, c, steps, a.threads)
                runs.setdefault((m, c), []).append(r)
                extra = (f", kept {r['kept']} keys/layer (bound {r['bound']}), prefill {r['fill_s']:.1f} s"
                         if "kept" in r else "")
                print(f"round {rnd + 1}: {m:>11} @ {c:>6}: " + (f"error {r['error']}" if "error" in r else
                      f"{r['ms_per_token']:.2f} CPU ms/token (wall {r['wall_ms_per_token']:.2f}), peak RSS {fmt(r['peak_rss_mib'], '.0f')} MiB, "
                      f"KV {r['kv_mib']:.2f} MiB{extra}"), flush=True)
    rows = []
    for (m, c), rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        best = dict(min(ok, key=lambda r: r["ms_per_token"])) if ok else rs[0]
        best["rounds_ms_per_token"] = [round(r["ms_per_token"], 2) for r in ok]
        rows.append(best)
    print("\n" + table(rows, contexts))
    ratios = {}
    by = {(r["method"], r["context"]): r for r in rows if "error" not in r}
    for m in a.methods:
        lo, hi = min(contexts), max(contexts)
        if (m, lo) in by and (m, 32768 if 32768 in contexts else hi) in by:
            mid = 32768 if 32768 in contexts else hi
            ratios[f"{m} time {mid // 1024}k/{lo // 1024}k"] = by[(m, mid)]["ms_per_token"] / by[(m, lo)]["ms_per_token"]
            ratios[f"{m} wall time {mid // 1024}k/{lo // 1024}k"] = (by[(m, mid)]["wall_ms_per_token"]
                                                                   / by[(m, lo)]["wall_ms_per_token"])
        m8 = 8192 if 8192 in contexts else lo
        if (m, m8) in by and (m, hi) in by and by[(m, hi)]["peak_rss_mib"]:
            ratios[f"{m} memory {hi // 1024}k/{m8 // 1024}k"] = by[(m, hi)]["peak_rss_mib"] / by[(m, m8)]["peak_rss_mib"]
    print("\nratios (goals for poslsh-s10: time 32k/1k <= 1.2, memory 128k/8k <= 1.1):")
    for k, v in ratios.items():
        print(f"  {k}: {v:.3f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"machine": machine(), "threads": a.threads, "steps": steps, "rows": rows, "ratios": ratios})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
