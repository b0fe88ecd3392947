"""What is particular to the language models' checkpoints (the files, their verification, resume
discovery and strict loading are shared: :mod:`poslsh_paper.experiments.checkpoints`): which
``TrainConfig`` a checkpoint belongs to (a foreign one is set aside on resume; a model that does
not fit says which recorded field differs), and what ``poslsh eval --checkpoint PATH`` means.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from poslsh_paper.experiments import checkpoints
from poslsh_paper.experiments.checkpoints import Named, latest_checkpoint, load_params, recorded_config
from poslsh_paper.experiments.command import ConfigError
from poslsh_paper.experiments.lm.config import config_differences, describe_differences

__all__ = ["prepare_resume", "load_strict", "resolve_checkpoint"]


def prepare_resume(run: Path, cfg=None) -> List[str]:
    """:func:`poslsh_paper.experiments.checkpoints.prepare_resume` for a run of ``cfg`` (a
    ``TrainConfig``): a checkpoint recorded under a config with another value of a field that
    changes results is foreign."""
    def differs(recorded: dict) -> str:
        diff = config_differences(cfg, recorded)
        return describe_differences({k: (b, a) for k, (a, b) in diff.items()}, "run:")
    return checkpoints.prepare_resume(run, differs if cfg is not None else None)


def load_strict(ckpt: Path, params: Named, cfg) -> None:
    """Copy checkpoint ``ckpt`` into ``params`` (a model built from ``cfg``, a ``TrainConfig``):
    every trainable tensor by name and shape, or one line naming the recorded configuration,
    the requested one and what to pass instead."""
    misfit = load_params(ckpt, params)
    if misfit is None:
        return
    recorded = recorded_config(ckpt)
    diff = {k: (b, a) for k, (a, b) in config_differences(cfg, recorded or {}).items()
            if k == "preset" or k.startswith(("model.", "data.tokenizer", "data.corpora"))}
    run = Path(ckpt).parent.parent
    said = (f"recorded {describe_differences(diff, 'requested')}" if diff else
            "recorded: no config" if recorded is None else "the configurations agree on the model")
    raise ConfigError(f"checkpoint {ckpt} does not fit the requested model ({misfit}); {said}; evaluate it with "
                      f"its own configuration: --config-json {run / 'config.json'} (with --method to change only "
                      "the positional scheme)")


def resolve_checkpoint(path: Optional[str], run: Path) -> Path:
    """The checkpoint ``poslsh eval --checkpoint PATH`` means: a checkpoint directory, a run
    directory (its latest), or a ``checkpoints/latest`` pointer; no PATH: ``run``'s latest."""
    if path is None:
        ckpt = latest_checkpoint(run)
        if ckpt is None:
            raise ConfigError(f"checkpoint: no checkpoint under {run}: train the run first (poslsh train ...) "
                              "or pass --checkpoint")
        return ckpt
    ckpt = Path(path)
    if ckpt.name == "latest" and ckpt.is_file():                  # the pointer file itself
        ckpt = ckpt.parent / ckpt.read_text().strip()
    elif not (ckpt / "model.safetensors").exists():               # a run directory
        ckpt = latest_checkpoint(ckpt) or ckpt
    if not (ckpt / "model.safetensors").exists():
        raise ConfigError(f"checkpoint: {path} is not a checkpoint (no model.safetensors): pass a checkpoint "
                          "directory, its checkpoints/latest pointer, a run directory, or init (the untrained model)")
    return ckpt
