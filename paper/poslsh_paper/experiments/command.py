"""What a job hands to the CLI: a config dataclass, named presets and a ``main``.

Every subcommand of ``poslsh`` is one :class:`Command`. The CLI (:mod:`poslsh_paper.cli`)
builds its flags from ``config`` with tyro (one flag per field, nested dataclasses
as ``--model.hidden-size``; the comment after a field is its help), starts from
``presets[--preset]`` and calls ``main(cfg)``. Jobs never parse arguments.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Command", "ConfigError", "preset_config"]


class ConfigError(ValueError):
    """A user-facing configuration problem; the CLI prints it as one line (exit code 2)."""


@dataclass(frozen=True)
class Command:
    name: str                       # the subcommand: ``poslsh <name>``
    help: str                       # one line for ``poslsh --help``
    config: type                    # dataclass the flags are built from
    presets: Mapping[str, Any]      # preset name -> config (an instance of ``config`` or of a base class)
    default_preset: str             # used when no ``--preset`` is given
    main: Callable[[Any], int]      # run the job on a full config; returns the exit code

    def preset(self, name: str) -> Any:
        """A deep copy of preset ``name`` as an instance of :attr:`config`."""
        if name not in self.presets:
            raise ConfigError(f"--preset: unknown preset {name!r} for `poslsh {self.name}`; "
                              f"choose from {', '.join(sorted(self.presets))}")
        return preset_config(self.config, self.presets[name])


def preset_config(config_type: type, preset: Any) -> Any:
    """``preset`` (deep-copied) as a ``config_type``: a base-class preset gets the
    subclass's defaults for the fields it lacks."""
    preset = copy.deepcopy(preset)
    if isinstance(preset, config_type):
        return preset
    return config_type(**{f.name: getattr(preset, f.name) for f in dataclasses.fields(preset) if f.init})
