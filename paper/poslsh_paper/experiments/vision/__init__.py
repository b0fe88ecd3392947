"""Vision transformers with 2-D positional LSH (paper section 5): ``poslsh vision``.

* :mod:`.config`: ``VisionConfig`` / ``ViTConfig``, methods, presets (``smoke``, ``cpu``);
* :mod:`.model`: a small ViT whose attention carries one positional method;
* :mod:`.train`: one run (resumable safetensors checkpoints), evaluation at 1x and 2x resolution;
* :mod:`.findings`: the paper-style claims, only of the methods trained, none established by one seed;
* :mod:`.table`: every method x seed (the sweep runner, :mod:`poslsh_paper.experiments.sweep`), aggregation;
* :mod:`.figure`: the 2-D Figure-2 analog on a trained model's patch Q/K/V;
* :mod:`.commands`: the CLI command.
"""
from poslsh_paper.experiments.vision.commands import COMMANDS

__all__ = ["COMMANDS"]
