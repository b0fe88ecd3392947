"""Language models with positional LSH: the paper's section 6.2, scaled down.

``poslsh train --preset cpu --method poslsh-s10`` trains and evaluates one run;
``poslsh table --preset cpu`` runs every method x seed and writes the table.
Each module owns one thing; imports point one way (config <- model, checkpoint
<- loop, evaluation, findings <- table <- commands):

* :mod:`.config`: ``TrainConfig``/``ModelConfig``, the presets, methods, the
  command configs (run options that are not saved with a run), the checks;
* :mod:`.model`: the model of a method (scratch Qwen3-style or LoRA), DDP facts, data;
* :mod:`.checkpoint`: the LM rules on the shared checkpoints (:mod:`poslsh_paper.experiments.checkpoints`):
  foreign checkpoints, strict loading's message, resolving ``--checkpoint``;
* :mod:`.loop`: ``train``: optimizer, HF's linear LR schedule, resume, steps, ETA;
* :mod:`.evaluation`: perplexity and accuracy at 1x, 2x, 4x the training length;
* :mod:`.findings`: the paper's claims (Table 1's from scratch, Table 2's fine-tuned) checked;
* :mod:`.table`: the table's sweep (:mod:`poslsh_paper.experiments.sweep`), aggregation over seeds, rendering, dry run;
* :mod:`.commands`: the ``train``, ``eval`` and ``table`` CLI commands.
"""
import importlib

__all__ = ["PRESETS", "ModelConfig", "TrainConfig", "get_preset", "parse_method", "build_model", "train",
           "evaluate", "run_table"]

# Imported on first use (PEP 562): `poslsh train --help` imports .commands and .config only,
# never torch through .loop, .model or .table.
_WHERE = {"PRESETS": "config", "ModelConfig": "config", "TrainConfig": "config", "get_preset": "config",
          "parse_method": "config", "build_model": "model", "train": "loop", "evaluate": "evaluation",
          "run_table": "table"}


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
