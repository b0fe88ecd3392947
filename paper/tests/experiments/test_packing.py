"""``poslsh train --pack``: the same training windows cut into documents at their separators,
positions restarting at 0 in every document, no attention across documents, every target once.

The oracle: a packed row's loss is the sum of its documents' losses, each document run alone
(float64, every method); the data keep every token once; packed runs are recorded, named and
tabulated apart from unpacked ones, and one table can hold both (unpacked runs included)."""
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from poslsh_paper.cli import main as poslsh_main  # noqa: E402
from poslsh_paper.data.tokens import batch_windows, document_positions, num_windows  # noqa: E402
from poslsh_paper.experiments.command import ConfigError  # noqa: E402
from poslsh_paper.experiments.lm import loop, table  # noqa: E402
from poslsh_paper.experiments.lm.config import (check, config_differences, get_preset, layout_name,  # noqa: E402
                                                run_dir)
from poslsh_paper.experiments.lm.loop import make_optimizer, lr_scheduler, train, train_step  # noqa: E402
from poslsh_paper.experiments.lm.model import Dist, build_model, trainable_parameters  # noqa: E402
from poslsh_paper.experiments.serialize import config_to_dict  # noqa: E402

from test_train import tiny_cfg  # noqa: E402

SEP = 0
METHODS = ["original", "alibi", "poslsh-s3", "fixed_blocks", "alibi-wcost2", "alibi-w1.5"]


def test_document_positions_restart_at_every_separator():
    x = np.array([[5, 6, SEP, 7, 8, 9, SEP, SEP, 4],
                  [SEP, 1, 2, 3, 4, 5, 6, 7, 8],
                  [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    assert document_positions(x, SEP).tolist() == [[0, 1, 0, 1, 2, 3, 0, 0, 1],
                                                   [0, 1, 2, 3, 4, 5, 6, 7, 8],
                                                   [0, 1, 2, 3, 4, 5, 6, 7, 8]]   # no separator: as unpacked
    assert document_positions(x, SEP).dtype == np.int64
    with pytest.raises(ValueError, match="rows, n"):
        document_positions(x[0], SEP)


def test_packed_windows_keep_every_token_once():
    """An epoch of packed windows holds every input token and every target once; its documents,
    read in stream order, are the stream cut at the separators (each opening the next document)
    and at window ends, nothing dropped, padded or repeated."""
    rng = np.random.default_rng(0)
    stream = rng.integers(1, 50, 1001).astype(np.uint16)
    stream[rng.choice(1000, 60, replace=False)] = SEP
    L, num = 10, num_windows(stream, 10)
    epoch = np.concatenate([batch_windows(stream, L, t, 4, seed=3) for t in range(num // 4)])
    where = {tuple(stream[w * L: w * L + L + 1]): w * L for w in range(num)}
    starts = [where[tuple(row)] for row in epoch]
    assert sorted(starts) == [w * L for w in range(num)]        # every window once per epoch
    pieces, targets = [], []
    for i in np.argsort(starts):
        row = epoch[i]
        for a, b in _documents(row[:-1]):
            doc = row[a:b]
            assert (doc[1:] != SEP).all() and (a == 0 or doc[0] == SEP)   # a separator only ever opens one
            pieces.append(doc)
            targets.append(row[a + 1:b + 1])
    np.testing.assert_array_equal(np.concatenate(pieces), stream[:num * L])          # each input once, in order
    np.testing.assert_array_equal(np.concatenate(targets), stream[1:num * L + 1])    # each target once


def _documents(row):
    pos = document_positions(row[None], SEP)[0]
    cuts = np.flatnonzero(pos == 0).tolist() + [len(row)]
    return list(zip(cuts[:-1], cuts[1:]))


@pytest.mark.parametrize("method", METHODS)
def test_packed_loss_is_the_sum_of_the_documents_alone(tmp_path, method):
    """float64: train_step's loss on packed rows equals the documents' losses, each run alone
    (positions from 0, nothing of any other document), in training mode at the same step; the
    same rows unpacked give another loss (the test can fail)."""
    cfg = tiny_cfg(tmp_path, method=method, pack=True, batch_size=2, micro_batch_size=2, seq_len=24, lr=1e-12,
                   grad_clip=0.0)
    torch.manual_seed(1)
    model = build_model(cfg, 300).double().train()
    batch = torch.randint(1, 300, (2, 25))
    batch[0, [4, 5, 13]] = SEP            # documents of 4, 1, 8 and 11 inputs (two separators in a row)
    batch[1, [0, 19]] = SEP               # a row that opens with a separator
    positions = torch.from_numpy(document_positions(batch[:, :-1].numpy(), SEP))
    params = trainable_parameters(model)
    opt = make_optimizer(params, cfg)
    step = 7
    dist = Dist("cpu")
    loss = train_step(model, opt, lr_scheduler(opt, cfg), params, batch, step, cfg, dist, 2, positions=positions)
    # (lr 0 at the schedule's first step: the weights did not move)
    alone = 0.0
    with torch.no_grad():
        for r in range(2):
            for a, b in _documents(batch[r, :-1].numpy()):
                logits = model(input_ids=batch[r:r + 1, a:b], use_cache=False, poslsh_step=step).logits[0]
                alone += float(F.cross_entropy(logits, batch[r, a + 1:b + 1], reduction="sum"))
        unpacked = float(F.cross_entropy(model(input_ids=batch[:, :-1], use_cache=False, poslsh_step=step)
                                         .logits.reshape(-1, 300), batch[:, 1:].reshape(-1), reduction="sum"))
        exact = float(F.cross_entropy(model(input_ids=batch[:, :-1], position_ids=positions, use_cache=False,
                                            poslsh_step=step).logits.reshape(-1, 300), batch[:, 1:].reshape(-1),
                                      reduction="sum"))
    n = 2 * 24
    assert exact == pytest.approx(alone, rel=1e-10), (exact, alone)      # float64 throughout
    assert loss == pytest.approx(alone / n, rel=1e-6), (loss, alone / n)   # train_step scores float32 logits
    assert abs(unpacked - alone) > 1e-3


def test_a_packed_run_is_recorded_and_named_apart(tmp_path, monkeypatch):
    seen = []
    real = loop.train_step

    def spy(*args, **kwargs):
        seen.append(args[-1] if len(args) > 10 else kwargs.get("positions"))
        return real(*args, **kwargs)
    monkeypatch.setattr(loop, "train_step", spy)
    cfg = tiny_cfg(tmp_path, method="poslsh-s2", pack=True, steps=3)
    result = train(cfg, progress=False)
    assert result["pack"] is True and len(seen) == 3 and all(p is not None for p in seen)
    restarts = sum(int((p[:, 1:] == 0).sum()) for p in seen)     # documents opening inside a window
    assert restarts > 0, "no separator in 3 steps of windows: the test's data do not exercise packing"
    assert json.loads((run_dir(cfg) / "config.json").read_text())["pack"] is True
    code = result["code"]          # the commit of the checkout that trained it (None outside git)
    assert code is None or (len(code["commit"]) == 40 and isinstance(code["modified"], bool))
    assert layout_name(cfg) == "smoke-packed" and run_dir(cfg).parts[-3:] == ("smoke-packed", "poslsh-s2", "seed0")
    assert run_dir(replace(cfg, pack=False)).parts[-3] == "smoke"
    pack = get_preset("cpu-pack")
    assert pack.pack and layout_name(pack) == "cpu-pack" and layout_name(replace(pack, pack=False)) == "cpu-pack-unpacked"
    assert replace(pack, preset="cpu", pack=False, methods=get_preset("cpu").methods, seeds=(0, 1, 2)) == get_preset("cpu")
    # a record made before packing existed is an unpacked run, not another configuration
    old = {k: v for k, v in config_to_dict(replace(cfg, pack=False)).items() if k != "pack"}
    assert config_differences(replace(cfg, pack=False), old) == {}
    assert config_differences(cfg, old) == {"pack": (True, False)}
    with pytest.raises(ConfigError, match="context_parallel"):
        check(replace(cfg, context_parallel=2), data=False)
    # evaluation is the same for packed and unpacked runs; --documents keeps each window's documents apart
    # (the synthetic test split's first separator is at token 961: score 1184 tokens to cross it)
    conf = ["--config-json", str(run_dir(cfg) / "config.json"), "--no-progress", "--eval-multipliers", "1",
            "--eval-tokens", "1200"]
    assert poslsh_main(["eval", *conf]) == 0 and poslsh_main(["eval", *conf, "--documents"]) == 0
    stream = json.loads((run_dir(cfg) / "eval-test.json").read_text())
    docs = json.loads((run_dir(cfg) / "eval-test-documents.json").read_text())
    assert docs["documents"] is True and stream["documents"] is False and docs["pack"] is True
    assert docs["eval"]["1x"]["tokens"] == stream["eval"]["1x"]["tokens"] == 1184
    assert docs["eval"]["1x"]["ppl"] != stream["eval"]["1x"]["ppl"] and math.isfinite(docs["eval"]["1x"]["ppl"])
    assert poslsh_main(["eval", *conf, "--documents", "--streaming"]) == 2


def test_a_packed_table_shows_unpacked_runs_beside_its_own(tmp_path, capsys):
    """--include-runs of an unpacked table in a packed one: its runs are rows of their own
    (labelled), the findings are checked on both packings, the note says which came from where."""
    base = tiny_cfg(tmp_path, steps=3, seeds=(0,))
    for m in ("alibi", "poslsh-s2"):
        train(replace(base, method=m), progress=False)
    table.run_table(base, ["alibi", "poslsh-s2"], [0], tmp_path / "earlier", progress=False, train_missing=False,
                    command="unpacked")
    old = tmp_path / "earlier" / "smoke" / "table.json"
    packed = replace(base, pack=True)
    results = table.run_table(packed, ["alibi", "poslsh-s2"], [0], tmp_path / "results", progress=False,
                              train_missing=True, include=old)
    assert sorted((r["method"], bool(r.get("pack"))) for r in results) == [
        ("alibi", False), ("alibi", True), ("poslsh-s2", False), ("poslsh-s2", True)]
    md = (tmp_path / "results" / "smoke-packed" / "table.md").read_text()
    print(md)
    assert "| ALiBi, unpacked | 1 |" in md and "| ALiBi, packed | 1 |" in md
    assert "2 run(s) taken from" in md and "alibi (1), poslsh-s2 (1) unpacked, shown beside" in md
    assert "On the unpacked rows: PosLSH s=2 within about 1% of ALiBi" in md
    assert "Packing leaves the verdicts unchanged (1 claim checked" in md and "Packing moves ALiBi's PPL" in md
    saved = json.loads((tmp_path / "results" / "smoke-packed" / "table.json").read_text())
    assert saved["meta"]["pack"] is True and {r["pack"] for r in saved["rows"]} == {False, True}
    # the packed table again includes its own runs as stand-ins, and the unpacked ones beside them
    again = table.run_table(replace(packed, runs_dir=str(tmp_path / "none")), ["alibi"], [0], tmp_path / "r2",
                            progress=False, train_missing=False, include=tmp_path / "results" / "smoke-packed" / "table.json")
    assert sorted(bool(r.get("pack")) for r in again) == [False, True]
    with pytest.raises(ConfigError, match="another setup"):
        table.run_table(replace(packed, lr=packed.lr * 2), ["alibi"], [0], tmp_path / "r3", progress=False,
                        train_missing=False, include=old)


def test_packing_findings():
    def run(method, seed, pack, p1):
        return {"method": method, "seed": seed, "pack": pack, "eval": {"1x": {"context": 8, "ppl": p1, "acc": 40.0}}}
    res = [run("alibi", 0, False, 20.0), run("poslsh-s10", 0, False, 20.1), run("alibi", 0, True, 19.0),
           run("poslsh-s10", 0, True, 19.6)]
    rows = table.aggregate(res, ["alibi", "poslsh-s10"])
    found = table.findings(rows, pack=True)
    print("\n".join(found))
    assert found[0].startswith("PosLSH s=10 within about 1% of ALiBi at the training length (PPL gap +3.16%")
    assert found[0].endswith("does NOT hold.")
    assert found[1].startswith("On the unpacked rows: PosLSH s=10 within about 1%") and found[1].endswith(": holds.")
    assert "changed: PosLSH s=10 within about 1% of ALiBi at the training length): does NOT hold." in found[2]
    assert found[3] == "Packing moves ALiBi's PPL by at most 1% at every length (1x: -5.00%): does NOT hold."
    assert len(found) == 5
