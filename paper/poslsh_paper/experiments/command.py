"""What a job hands to the CLI: a config dataclass, named presets and a ``main``.

Every subcommand of ``poslsh`` is one :class:`Command`. The CLI (:mod:`poslsh_paper.cli`)
builds its flags from ``config`` with tyro (one flag per field, nested dataclasses
as ``--model.hidden-size``; the comment after a field is its help), starts from
``presets[--preset]`` and calls ``main(cfg)``. Jobs never parse arguments.

A command's module is imported for ``poslsh --help`` and ``poslsh <command> --help``, so it
holds the config and the presets only; ``main`` may be named as ``"module:function"`` and is
imported when the command runs (torch and the models are loaded then, not for the help).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

__all__ = ["Command", "ConfigError", "DiskFull", "preset_config"]


class ConfigError(ValueError):
    """A user-facing configuration problem; the CLI prints it as one line (exit code 2)."""


class DiskFull(ConfigError):
    """A write ran out of space; the message names the path (the CLI prints one line, exit 2)."""


@dataclass(frozen=True)
class Command:
    name: str                       # the subcommand: ``poslsh <name>``
    help: str                       # one line for ``poslsh --help``
    config: type                    # dataclass the flags are built from
    presets: Mapping[str, Any]      # preset name -> config (an instance of ``config`` or of a base class)
    default_preset: str             # used when no ``--preset`` is given
    main: Union[Callable[..., int], str]   # runs the job on a full config (or "module:function")
    quick: Optional[str] = None     # the preset ``--quick`` stands for (None: the command has none)
    preset_help: Mapping[str, str] = field(default_factory=dict)   # preset -> a few words for --help
    # flags of sibling commands that do nothing here: field name -> the command where they act
    elsewhere: Mapping[str, str] = field(default_factory=dict)
    takes_given: bool = False       # main(cfg, given=...) gets the fields set by flags (not by the preset)

    def preset(self, name: str) -> Any:
        """A deep copy of preset ``name`` as an instance of :attr:`config`."""
        if name not in self.presets:
            raise ConfigError(f"--preset: unknown preset {name!r} for `poslsh {self.name}`; "
                              f"choose from {', '.join(self.presets)}")
        return preset_config(self.config, self.presets[name])

    def run(self, cfg: Any, given=frozenset()) -> int:
        """Import (if named by a string) and call ``main``."""
        main = self.main
        if isinstance(main, str):
            module, _, attr = main.partition(":")
            main = getattr(importlib.import_module(module), attr)
        return main(cfg, given=given) if self.takes_given else main(cfg)


def preset_config(config_type: type, preset: Any) -> Any:
    """``preset`` (deep-copied) as a ``config_type``: a base-class preset gets the
    subclass's defaults for the fields it lacks."""
    preset = copy.deepcopy(preset)
    if isinstance(preset, config_type):
        return preset
    return config_type(**{f.name: getattr(preset, f.name) for f in dataclasses.fields(preset) if f.init})
