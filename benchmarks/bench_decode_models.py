"""CPU benchmark: decoding at long context from a transformers BLOOM, eager against ``patch_alibi`` (exact on
the AppendCache, certified on the per-head bounded cache), per generated token, side by side in one process.

Model: ``BloomForCausalLM`` at BLOOM-560m's shapes (1024 wide, 16 heads of 64, MLP 4096), random init
(``torch.manual_seed(0)``), ``--layers`` layers (2) and the vocabulary shrunk to ``--vocab`` (4096; the real
250,880 adds a 1 GiB unembedding read per token, the same for every method), float32, ``eval()``, greedy.
The 24-layer figure is arithmetic: the step's time outside the layers plus 24 times the mean layer time,
each measured by forward hooks on the blocks during the timed steps.

Contexts ``--contexts`` (1k, 4k, 16k, 32k) at batch ``--batches`` (1, 8). **The caches are filled, not
prefilled**: a prefill of 32k tokens through exact attention takes minutes per layer here, and no method's
decoding time depends on the values it reads. A real prompt of 1,024 tokens is prefilled once: the exact
model's keys and values of every layer, repeated along the context and the batch, fill every method's cache as
its own type holds them: eager a ``DynamicCache`` (``update``), exact an ``AppendCache`` (``update``: room for
an eighth more), certified ``alibi_cache(model)`` (each layer's ``fill``: the last ``w_j + 1`` keys per KV
head, the running key norms and value ranges of all). The certified windows are those ``generate()`` chooses
from that prompt (its prefill on the per-head cache: ``tol = 1e-3``, the prompt's Cauchy-Schwarz logit range,
``n=None``); every step is then checked by the cache's certificate (``Certificate(1e-3, "warn")``; its worst
bound and exceedances are reported).

Time per token: inside one ``generate()`` call (the context's tokens as ``input_ids``, the filled cache,
``--steps`` new tokens), the median interval between consecutive decoding steps (a stopping criterion stamps
each step; the prefill is a single uncached token and is not timed). The methods run in interleaved rounds
(``--rounds``), each round one ``generate()`` per method continuing its own cache; the median of the rounds'
medians is reported with the best round, and the floor under exact attention: one pass reading every key and
value held (``sum``). One intra-op thread (``--threads``): on a 2-core machine shared
with other work, two threads wait on each other's barriers in every small op (measured: a 1k-context step
10 ms with one thread, 70-430 ms with two under a load of 1.5). KV bytes: what each cache holds (certified:
against the bound ``sum_j (w_j + 1) (dk + dv) 4`` per layer and sequence). Eager is skipped where its cache and
``DynamicCache``'s concatenation (two copies at once) would not fit in the memory available.

Run: ``python benchmarks/bench_decode_models.py [--quick] [--out results/alibi-models/decode.json]``.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, machine, markdown_table, write_json  # noqa: E402

TOL = 1e-3
METHODS = ("eager", "exact", "certified")
HEADS, HEAD_DIM, WIDTH, REAL_LAYERS = 16, 64, 1024, 24
PROMPT = 1024                    # tokens of the real prefill that chooses the certified windows


def build(layers: int, vocab: int):
    """The three models (the same weights): eager (untouched), exact and certified (patched)."""
    import torch
    import transformers

    from poslsh.integrations.hf import patch_alibi

    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=vocab, hidden_size=WIDTH, n_layer=layers, n_head=HEADS)
    base = transformers.BloomForCausalLM(cfg).eval()
    return {"eager": base, "exact": patch_alibi(copy.deepcopy(base)),
            "certified": patch_alibi(copy.deepcopy(base), window="certified", tol=TOL)}


def from_prompt(models, vocab: int, prompt: int = PROMPT):
    """What a real prompt of ``prompt`` tokens gives: the certified windows ``generate()`` keeps (per layer ``[H]``
    ints, chosen from its prefill on the per-head cache), their logit ranges, and every layer's keys and values
    (the exact model's prefill on an AppendCache, ``[(k [1, H, prompt, d], v)]``)."""
    import torch

    from poslsh.integrations.hf import AppendCache, alibi_cache, alibi_stats

    model = models["certified"]
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(1)).to(model.device)
    full = AppendCache()
    with torch.no_grad():
        model(ids, cache=alibi_cache(model), use_cache=True)
        models["exact"](ids, cache=full, use_cache=True)
    stats = alibi_stats(model)
    return ([s["window"] for s in stats], [s["logit_range"] for s in stats],
            [(layer.keys.clone(), layer.values.clone()) for layer in full.layers])


def filled_caches(models, windows, kv, B: int, L: int, with_eager: bool):
    """Each method's cache holding the same keys and values of ``L`` tokens per layer: the prompt's (``kv``, from
    :func:`from_prompt`) repeated along the context and the batch."""
    import torch
    import transformers

    from poslsh.integrations.hf import AppendCache, alibi_cache
    from poslsh.window import make_window

    caches = {"exact": AppendCache(), "certified": alibi_cache(models["certified"])}
    if with_eager:
        caches["eager"] = transformers.DynamicCache()
    slopes = models["certified"].transformer.h[0].self_attention._poslsh_alibi.slopes
    for i, (k0, v0) in enumerate(kv):
        reps = -(-L // k0.shape[2])
        k = k0.repeat(B, 1, reps, 1)[:, :, :L]
        v = v0.repeat(B, 1, reps, 1)[:, :, :L]
        caches["exact"].update(k, v, i)
        if with_eager:
            caches["eager"].update(k, v, i)
        caches["certified"].layers[i].fill(make_window(slopes, torch.tensor(windows[i])), k, v, start=0, pads=[0] * B)
        del k, v
    return caches


def kv_bytes(cache) -> int:
    from poslsh.integrations.hf import AppendCache, PoslshCache

    if isinstance(cache, (AppendCache, PoslshCache)):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


class Stamps:
    """A stopping criterion that stamps every decoding step of ``generate()`` and stops nothing."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        if input_ids.is_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class LayerClock:
    """Forward hooks on the blocks: seconds spent inside them."""

    def __init__(self, model):
        self.total, self._t0 = 0.0, None
        self.handles = []
        for block in model.transformer.h:
            self.handles.append(block.register_forward_pre_hook(self._start))
            self.handles.append(block.register_forward_hook(self._stop))

    def _start(self, *args):
        self._t0 = time.perf_counter()

    def _stop(self, *args):
        self.total += time.perf_counter() - self._t0

    def remove(self):
        for h in self.handles:
            h.remove()


def decode_round(model, cache, ids, steps: int):
    """One ``generate()`` of ``steps`` tokens continuing ``ids`` on ``cache``: (the new ids, median step seconds,
    layer seconds per step)."""
    import torch
    from transformers import StoppingCriteriaList

    stamps, clock = Stamps(), LayerClock(model)
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=steps,
                                 do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([stamps]))
    finally:
        clock.remove()
    gaps = [b - a for a, b in zip(stamps.times, stamps.times[1:])]
    return out, statistics.median(gaps), clock.total / len(stamps.times)


def mem_available_gib() -> float:
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable"))
        return int(line.split()[1]) / 2 ** 20
    except (OSError, StopIteration, ValueError):
        return float("inf")


def run(args) -> dict:
    import torch

    models = build(args.layers, args.vocab)
    windows, ranges, kv = from_prompt(models, args.vocab)
    layers, rows = args.layers, []
    per_seq_bound = [sum(w + 1 for w in ws) * 2 * HEAD_DIM * 4 for ws in windows]       # bytes per layer and row
    for B in args.batches:
        for L in args.contexts:
            full = 2 * layers * B * HEADS * L * HEAD_DIM * 4 / 2 ** 30          # GiB of every key and value
            with_eager = 2 * full + 1.5 * full + 2 < mem_available_gib()
            caches = filled_caches(models, windows, kv, B, L, with_eager)
            ids = {m: torch.randint(0, args.vocab, (B, L + 1), generator=torch.Generator().manual_seed(L))
                   for m in caches}
            load0 = os.getloadavg()[0]
            times = {m: [] for m in caches}
            layer_times = {m: [] for m in caches}
            tokens = {}
            for r in range(args.rounds):
                order = list(caches)[r % len(caches):] + list(caches)[:r % len(caches)]
                for m in order:
                    out, t, lt = decode_round(models[m], caches[m], ids[m], args.steps)
                    tokens.setdefault(m, out[:, L + 1:])
                    ids[m] = out
                    times[m].append(t)
                    layer_times[m].append(lt)
            reads = []
            for _ in range(3):                   # the floor under exact: reading every key and value once
                t0 = time.perf_counter()
                for layer in caches["exact"].layers:
                    layer.keys.sum(), layer.values.sum()
                reads.append(time.perf_counter() - t0)
            load1 = os.getloadavg()[0]
            row = {"batch": B, "context": L, "layers": layers, "load": [round(load0, 2), round(load1, 2)],
                   "read_cache_ms": round(1e3 * statistics.median(reads), 2),
                   "eager_skipped": None if with_eager else "its cache and DynamicCache's concatenation do not fit"}
            for m in METHODS:
                if m not in caches:
                    continue
                med, lt = statistics.median(times[m]), statistics.median(layer_times[m])
                row[m] = {"ms_per_token": round(1e3 * med, 2), "best_round_ms": round(1e3 * min(times[m]), 2),
                          "rounds_ms": [round(1e3 * t, 2) for t in times[m]],
                          "layer_ms": round(1e3 * lt / layers, 2),
                          "ms_per_token_24_layers": round(1e3 * (med - lt + REAL_LAYERS * lt / layers), 1),
                          "kv_mib": round(kv_bytes(caches[m]) / 2 ** 20, 2),
                          "kv_mib_24_layers": round(kv_bytes(caches[m]) / 2 ** 20 * REAL_LAYERS / layers, 1)}
            row["exact"]["kv_held_mib"] = round(caches["exact"].held_bytes() / 2 ** 20, 2)
            cert = caches["certified"]
            row["certified"]["bytes_over_bound"] = round(max(
                layer.nbytes() / (B * bound) for layer, bound in zip(cert.layers, per_seq_bound)), 4)
            row["certified"]["certificate"] = {
                "worst": max(s["certificate"]["worst"] for s in cert.stats()),
                "exceeded": sum(sum(s["certificate"]["exceeded"]) for s in cert.stats()),
                "steps": cert.stats()[0]["certificate"]["steps"]}
            if "eager" in tokens:
                row["exact"]["first_round_tokens_equal_eager"] = bool(torch.equal(tokens["exact"], tokens["eager"]))
            print(f"B={B} L={L}: " + ", ".join(f"{m} {row[m]['ms_per_token']} ms ({row[m]['kv_mib']} MiB)"
                                                for m in METHODS if m in row) + f"; load {load0:.1f} -> {load1:.1f}",
                  flush=True)
            rows.append(row)
            del caches, ids
    return {"windows": windows, "logit_range": ranges, "rows": rows}


def table(result) -> str:
    def cell(r, m):
        x = r.get(m)
        return "—" if x is None else f"{x['ms_per_token']} · {x['kv_mib']}"

    return markdown_table(["B", "context", "eager ms · MiB", "exact ms · MiB", "certified ms · MiB", "read KV once ms"],
                          [(r["batch"], r["context"], cell(r, "eager"), cell(r, "exact"), cell(r, "certified"),
                            r["read_cache_ms"]) for r in result["rows"]])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 16384, 32768])
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8, help="tokens per generate() call (steps - 1 intervals)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads, every method alike")
    p.add_argument("--quick", action="store_true", help="1k and 4k, batch 1, 2 rounds of 4 tokens")
    p.add_argument("--out", default=str(ROOT / "results" / "alibi-models" / "decode.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.contexts, args.batches, args.rounds, args.steps = [1024, 4096], [1], 2, 4
    import torch

    torch.set_num_threads(args.threads)
    cpu = machine()
    uptime0 = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    t0 = time.time()
    result = run(args)
    uptime1 = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None
    result.update(machine=cpu, loadavg_before=uptime0, loadavg_after=uptime1, seconds=round(time.time() - t0),
                  config=dict(layers=args.layers, vocab=args.vocab, steps=args.steps, rounds=args.rounds,
                              tol=TOL, prompt=PROMPT, threads=torch.get_num_threads()),
                  method="filled caches; median interval between decoding steps inside one generate() call")
    if not args.quick or args.out != p.get_default("out"):
        write_json(args.out, result)
    print(cpu)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
