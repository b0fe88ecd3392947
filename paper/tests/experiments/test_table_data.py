"""A table is one experiment: runs trained on another corpus (an updated Debian documentation
package changes the documents, so the splits and every batch) are refused in one line, whether
they sit in the runs directory or come from an earlier table (``--include-runs``), and the
refusal comes before any training."""
import json

import pytest

from poslsh_paper.experiments.command import ConfigError
from poslsh_paper.experiments.lm.config import get_preset
from poslsh_paper.experiments.lm.include import describe, include_runs, one_data

OLD = {"train": {"documents": 3539, "tokens": 10942689}, "validation": {"documents": 65, "tokens": 225046}}
NEW = {"train": {"documents": 3540, "tokens": 10947677}, "validation": {"documents": 65, "tokens": 224832}}


def run(method, seed, data, cfg):
    return {"method": method, "seed": seed, "data": data, "preset": cfg.preset, "steps": cfg.steps, "pack": False}


def test_one_corpus_per_table():
    cfg = get_preset("cpu")
    same = [run("alibi", 0, NEW, cfg), run("poslsh-s10", 0, dict(NEW), cfg), {"method": "x", "seed": 0}]
    assert one_data(same) == NEW and one_data([{"method": "x", "seed": 0}]) is None
    assert "train 10,947,677" in describe(cfg, same)["setup"]
    with pytest.raises(ConfigError) as e:
        describe(cfg, same + [run("alibi", 1, OLD, cfg)])
    msg = str(e.value)
    assert "\n" not in msg and "different data" in msg
    assert ("train 3,540 documents / 10,947,677 tokens, validation 65 documents / 224,832 tokens: "
            "alibi seed 0, poslsh-s10 seed 0") in msg
    assert "train 3,539 documents / 10,942,689 tokens, validation 65 documents / 225,046 tokens: alibi seed 1" in msg


def test_included_runs_of_another_corpus_are_refused_before_training(tmp_path):
    cfg = get_preset("cpu")
    old = tmp_path / "table.json"
    old.write_text(json.dumps({"meta": {}, "runs": [run("alibi", s, OLD, cfg) for s in (0, 1)]}))
    wanted = [("alibi", 0), ("alibi", 1), ("alibi-wcost10", 0)]
    local = [run("alibi-wcost10", 0, NEW, cfg)]
    with pytest.raises(ConfigError, match="different data"):
        include_runs(old, cfg, [("alibi", 0), ("alibi", 1)], wanted, local)
    # on the same corpus the check passes on to the words of the set-up (here: none recorded)
    with pytest.raises(ConfigError, match="another setup"):
        include_runs(old, cfg, [("alibi", 0), ("alibi", 1)], wanted, [run("alibi-wcost10", 0, OLD, cfg)])


@pytest.mark.parametrize("text, says", [("{\"x\": 1}", "is not a table.json"), ("[1]", "is not a table.json"),
                                        ("{\"runs\": [{\"seed\": 0}]}", "is not a table.json"),
                                        ("not json", "cannot read the runs")])
def test_a_file_that_is_not_a_table_is_one_line(tmp_path, text, says):
    bad = tmp_path / "table.json"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=says) as e:
        include_runs(bad, get_preset("cpu"), [("alibi", 0)], [("alibi", 0)])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="cannot read the runs"):
        include_runs(tmp_path / "missing.json", get_preset("cpu"), [("alibi", 0)], [("alibi", 0)])
