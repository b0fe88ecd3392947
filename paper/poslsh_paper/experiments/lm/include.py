"""What a table says about its set-up, and the runs it takes from an earlier table.

:func:`describe` writes the set-up and evaluation of a table in words; two tables whose words
agree ran the same experiment. :func:`include_runs` takes the runs of an earlier ``table.json``
after checking exactly that: runs of the table's own packing stand in for runs that have no run
directory here; runs of the other packing (an unpacked table included in a packed one) are rows
of their own, beside the runs trained here, so one table compares packed with unpacked training.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence

from poslsh_paper.experiments.command import ConfigError
from poslsh_paper.experiments.lm.config import PRESETS, TrainConfig

__all__ = ["PACKING", "describe", "one_data", "Included", "include_runs", "included_note"]

# The set-up's words for packed training (unpacked tables say nothing, as they always did).
PACKING = (" Packed documents: each training window is cut at its separators into documents that restart "
           "at position 0 and see nothing of each other; every target counts, nothing is padded.")


def _data_words(data: dict) -> str:
    return ", ".join(f"{k} {v['documents']:,} documents / {v['tokens']:,} tokens" for k, v in data.items())


def one_data(results: List[dict]) -> Optional[dict]:
    """The split sizes every run of ``results`` was trained and evaluated on (None if no run
    records them). Runs whose corpus differs (an updated Debian documentation package changes the
    documents, so the splits and every batch) are not one experiment: one line naming them."""
    seen: Dict[str, tuple] = {}        # the data as one string -> (the data, the runs trained on it)
    for r in results:
        if r.get("data"):
            seen.setdefault(json.dumps(r["data"], sort_keys=True), (r["data"], []))[1].append(
                f"{r['method']} seed {r['seed']}")
    if len(seen) > 1:
        groups = "; ".join(f"{_data_words(data)}: {', '.join(names)}" for data, names in seen.values())
        raise ConfigError(f"the runs of this table were trained on different data ({groups}): the corpus changed "
                          "between them; table them apart (--methods / --seeds / --runs-dir, or without "
                          "--include-runs) or retrain the older runs on today's corpus")
    return next(iter(seen.values()))[0] if seen else None


def describe(cfg: TrainConfig, results: List[dict]) -> Dict[str, str]:
    """The table's setup and evaluation notes, in words (its runs must share one corpus: :func:`one_data`)."""
    m = cfg.model
    if m.kind == "scratch":
        model = (f"Qwen3-style model from scratch: {m.num_layers} layers, hidden {m.hidden_size}, "
                 f"{m.num_heads} query / {m.num_kv_heads} key-value heads of dim {m.head_dim}")
    elif m.kind == "bloom":
        model = (f"transformers' BloomForCausalLM from scratch (its own ALiBi, eager attention in training): "
                 f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads")
    else:
        model = f"{m.base} + LoRA (r {m.lora_r}, alpha {m.lora_alpha}, {'/'.join(m.lora_targets)}), RoPE replaced"
    data = one_data(results)
    train_tokens = cfg.steps * cfg.batch_size * cfg.seq_len
    setup = (f"{model}; corpora {', '.join(cfg.data.corpora)} (split by document), tokenizer {cfg.data.tokenizer}; "
             f"{cfg.steps} steps x {cfg.batch_size} sequences x {cfg.seq_len} tokens = {train_tokens:,} training "
             f"tokens; AdamW lr {cfg.lr}, weight decay {cfg.weight_decay}, warmup {cfg.warmup_ratio}"
             + ("." if m.kind == "bloom" else f"; fixed blocks of {cfg.fixed_block_size}."))
    if data:
        setup += " Split sizes (tokens): " + ", ".join(f"{k} {v['tokens']:,}" for k, v in data.items()) + "."
    if cfg.pack:
        setup += PACKING
    scored = results[0]["eval"]["1x"]["tokens"] if results and results[0].get("eval") else cfg.eval_tokens
    evaluation = (f"{cfg.eval_split} split, the same {scored:,} target tokens at every length; lengths "
                  f"{', '.join(str(k * cfg.seq_len) for k in cfg.eval_multipliers)} use a sliding window whose "
                  f"stride is the training length ({cfg.seq_len}), as in the paper; PosLSH evaluates with fixed "
                  f"partitions seeded by the run's seed.")
    return {"setup": setup, "evaluation": evaluation}


class Included(NamedTuple):
    """Runs taken from an earlier table: ``same`` (this table's packing: stand-ins for missing run
    directories), ``other`` (the other packing: rows of their own), the earlier table's ``meta``."""

    same: List[dict]
    other: List[dict]
    meta: dict


def _twins(cfg: TrainConfig) -> set:
    """``cfg.preset`` and the presets that differ from it only in packing (cpu and cpu-pack)."""
    own = PRESETS.get(cfg.preset)
    if own is None:
        return {cfg.preset}
    plain = replace(own, pack=False, methods=(), seeds=(), preset="")
    return {name for name, p in PRESETS.items() if replace(p, pack=False, methods=(), seeds=(), preset="") == plain}


def include_runs(path: Path, cfg: TrainConfig, missing: Sequence[tuple], wanted: Sequence[tuple],
                 local: Sequence[dict] = ()) -> Included:
    """The runs of an earlier ``table.json``: of this table's packing for the ``(method, seed)``
    pairs in ``missing`` (no result here), of the other packing for every pair in ``wanted``; after
    checking that the table was made for this preset (or its packing twin) with the same setup and
    evaluation (model, data and split sizes, optimiser, steps, scored tokens: its own words), and
    on the corpus of the runs already finished here (``local``: their results), before any training."""
    try:
        prev = json.loads(Path(path).read_text())
        runs = [r for r in prev["runs"] if (r["method"], r["seed"]) in set(wanted)]
    except (KeyError, TypeError) as e:
        raise ConfigError(f"include_runs: {path} is not a table.json of `poslsh table` (no list of runs with a "
                          f"method and a seed: {type(e).__name__} {e}); give the table.json next to a table.md") from e
    except (OSError, ValueError) as e:
        raise ConfigError(f"include_runs: cannot read the runs of table {path}: {e}") from e
    meta = prev.get("meta", {})
    same = [r for r in runs if bool(r.get("pack", False)) == cfg.pack and (r["method"], r["seed"]) in set(missing)]
    other = [r for r in runs if bool(r.get("pack", False)) != cfg.pack]
    if not same and not other:
        return Included([], [], meta)
    twins = _twins(cfg)
    bad = [f"{r['method']} seed {r['seed']}" for r in same + other
           if r.get("preset") not in twins or r.get("steps") != cfg.steps]
    if bad:
        raise ConfigError(f"include_runs: {path} holds runs of another preset or step count ({', '.join(bad)}): "
                          f"include a table made with --preset {cfg.preset} and {cfg.steps} steps")
    one_data(list(local) + same + other)
    # the earlier table's words are those of its own packing: the rest must agree exactly
    want = describe(replace(cfg, pack=bool(meta.get("pack", False))), same + other)
    for key in ("setup", "evaluation"):
        if meta.get(key) != want[key]:
            raise ConfigError(f"include_runs: {path} was made with another {key} than this table: "
                              f"{meta.get(key)!r} vs {want[key]!r}")
    return Included(same, other, meta)


def _count(runs: List[dict]) -> str:
    return ", ".join(f"{m} ({n})" for m, n in Counter(r["method"] for r in runs).items())


def _code(runs: List[dict]) -> str:
    """Which code trained ``runs``: commits (a run made before commits were recorded says so)."""
    said = Counter((r.get("code") or {}).get("commit", "")[:10] + ("+modified" if (r.get("code") or {}).get("modified")
                                                                    else "") for r in runs)
    return ", ".join(f"{c or 'not recorded'} ({n})" for c, n in said.items())


def included_note(inc: Included, path: Path, pack: bool) -> str:
    """The table's "Included" note: which runs came from where, of which packing and code."""
    runs = inc.same + inc.other
    note = (f"{len(runs)} run(s) taken from `{path}` (made by {inc.meta.get('command') or 'an earlier table'}, "
            f"same setup and evaluation): {_count(runs)}")
    if inc.other:
        note += (f"; of these, {_count(inc.other)} {'unpacked' if pack else 'packed'}, shown beside this table's "
                 f"{'packed' if pack else 'unpacked'} runs")
    note += f"; code of the included runs: {_code(runs)}; the other runs were trained for this table."
    if inc.meta.get("included"):
        note += f" (That table's own note: {inc.meta['included']})"
    return note
