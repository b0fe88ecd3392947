"""How far Falcon's bfloat16-rounded ALiBi bias moves the logits, at n = 2048 and 16384.

transformers' Falcon (``alibi=True``) forms its bias as ``slopes.bfloat16() * position`` in bfloat16:
at position ``p`` the bias of head ``h`` is off by up to half a bfloat16 step of ``m_h p``. This script
compares, on a tiny random-init Falcon in float32 (8 heads of dimension 8, 2 layers, vocabulary 256,
seed 0), the untouched model (its default sdpa path; at 16k it runs as a chunked prefill through its
own DynamicCache, 1024 queries per chunk, since one 16k x 16k float mask per head does not fit; at 2048
the chunked and the one-call prefill are compared too) with ``patch_alibi(falcon_bias="exact")`` and
``patch_alibi(falcon_bias="bfloat16")``, and reports the largest and mean absolute logit difference
over all positions and over the last 256, plus the largest bias rounding ``|bf16(bf16(m) p) - m p| /
sqrt(d)`` up to ``n``. At 2048 it also measures the explicit ``attn_implementation="eager"`` path,
which adds the bias twice.

Run from the repository root: ``python paper/measurements/falcon_bias.py``; writes
``results/alibi-models/falcon_bias.json``.
"""
import copy
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.bench_common import machine, write_json  # noqa: E402
from poslsh.integrations.hf import patch_alibi  # noqa: E402

LENGTHS = (2048, 16384)
CHUNK = 1024
OUT = Path("results/alibi-models/falcon_bias.json")


def falcon():
    from transformers import FalconConfig, FalconForCausalLM
    torch.manual_seed(0)
    cfg = FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, alibi=True,
                       new_decoder_architecture=False, multi_query=False, bias=True)
    return FalconForCausalLM(cfg).eval()


def chunked(model, x):
    from transformers import DynamicCache
    cache, outs = DynamicCache(config=model.config), []
    for c0 in range(0, x.shape[1], CHUNK):
        outs.append(model(x[:, c0:c0 + CHUNK], cache=cache, use_cache=True).logits)
    return torch.cat(outs, 1)


def diff(a, b):
    d = (a - b).abs()
    return {"max": float(d.max()), "mean": float(d.mean()), "max_last_256": float(d[:, -256:].max())}


def rounding(n, heads=8, head_dim=8):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    m = _get_alibi_slopes(heads, torch.device("cpu"))
    p = torch.arange(n)
    err = ((m.bfloat16()[:, None] * p[None]).double() - m.double()[:, None] * p[None]).abs() / math.sqrt(head_dim)
    return {"max_over_heads": float(err.max()), "per_head": [float(e) for e in err.amax(1)]}


def main():
    base = falcon()
    rows = []
    for n in LENGTHS:
        x = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n))
        t0 = time.perf_counter()
        with torch.no_grad():
            untouched = chunked(base, x)
            row = {"n": n, "bias_rounding": rounding(n)}
            if n <= 2048:
                row["chunked_vs_one_call"] = diff(untouched, base(x).logits)
                eager = copy.deepcopy(base)
                eager.config._attn_implementation = "eager"
                row["eager_vs_sdpa"] = diff(eager(x).logits, untouched)
            exact = patch_alibi(copy.deepcopy(base))(x).logits
            bf16 = patch_alibi(copy.deepcopy(base), falcon_bias="bfloat16")(x).logits
        row["exact_vs_untouched"] = diff(exact, untouched)
        row["bfloat16_vs_untouched"] = diff(bf16, untouched)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(n, {k: v for k, v in row.items() if k != "bias_rounding"}, flush=True)
    write_json(OUT, {"what": __doc__.split("\n\n")[1].replace("\n", " "), "machine": machine(),
                     "model": "FalconForCausalLM, hidden 64, 8 heads, 2 layers, vocab 256, float32, seed 0",
                     "rows": rows})
    print("wrote", OUT)


if __name__ == "__main__":
    main()
