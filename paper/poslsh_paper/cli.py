"""The ``poslsh`` command: every subcommand generated from a job's config dataclass.

``poslsh <command> [--preset NAME | --quick] [--config-json FILE] [--FIELD VALUE ...]``: flags
are built by tyro from the command's config dataclass (see
:class:`poslsh_paper.experiments.command.Command`); ``--set key=value`` is an alias of
``--key value`` (``--set model.hidden_size=256``, lists comma-separated), and ``--quick`` of
``--preset <the command's small preset>``. Errors in the configuration (and a full disk) print
one line and exit with code 2 (``--debug`` shows the traceback); Ctrl-C exits with 130. SIGTERM
(``kill``, batch schedulers) is handled like Ctrl-C (a training run saves its checkpoint) and
exits with 143: a job started in the background by a script ignores SIGINT, so SIGTERM is how it
is stopped.

Help costs no heavy import: the modules of :data:`COMMAND_MODULES` hold configs and presets
only (torch, transformers and matplotlib are imported when a command runs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import signal
import sys
import textwrap
import threading
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from poslsh_paper.experiments.command import Command, ConfigError

__all__ = ["COMMAND_MODULES", "commands", "main", "overview", "parse", "parse_given", "common_help"]

# Modules that define subcommands: each exposes ``COMMANDS``, a list of Command, and imports
# nothing heavy (tests/test_cli_help.py checks that --help loads no torch).
COMMAND_MODULES = [
    "poslsh_paper.experiments.demo_config",
    "poslsh_paper.experiments.bounds",
    "poslsh_paper.experiments.convergence_config",
    "poslsh_paper.experiments.audit_config",
    "poslsh_paper.experiments.lm.commands",
    "poslsh_paper.experiments.generate",
    "poslsh_paper.experiments.vision.commands",
    "poslsh_paper.experiments.frontier_config",
]
WIDTH = 100


def commands() -> Dict[str, Command]:
    out: Dict[str, Command] = {}
    for name in COMMAND_MODULES:
        for cmd in importlib.import_module(name).COMMANDS:
            out[cmd.name] = cmd
    return out


def _wrap(text: str, indent: str = "", first: str = "") -> List[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first or indent, subsequent_indent=indent,
                         break_on_hyphens=False, break_long_words=False)


def overview(cmds: Dict[str, Command]) -> str:
    width = max(map(len, cmds))
    pad = " " * (width + 4)
    lines = ["usage: poslsh COMMAND [--preset NAME | --quick] [--config-json FILE] [--FLAG VALUE ...]",
             "       poslsh COMMAND --help   (the flags of COMMAND, its presets, their defaults)",
             "", "Positional-LSH reproduction. Commands, and their presets (the default first):"]
    for name, cmd in cmds.items():
        lines += _wrap(cmd.help, pad, f"  {name:<{width}}  ")
        quick = f"; --quick = {cmd.quick}" if cmd.quick else ""
        lines += _wrap(f"presets: {', '.join(_ordered(cmd))}{quick}", pad)
    lines += [""] + _wrap("Common flags: --preset NAME; --quick (the command's small preset); --config-json FILE "
                          "(start from a saved config, e.g. a run's config.json); --set KEY=VALUE (= --KEY VALUE, "
                          "lists comma-separated); --debug (show tracebacks).")
    return "\n".join(lines)


def _ordered(cmd: Command) -> List[str]:
    return [cmd.default_preset] + [p for p in cmd.presets if p != cmd.default_preset]


def common_help(cmd: Command) -> str:
    """The flags every command takes (handled here, not by tyro), with ``cmd``'s presets."""
    rows = [(f"--preset {{{','.join(_ordered(cmd))}}}",
             f"start from a named configuration (default: {cmd.default_preset}); the defaults shown above are "
             "that preset's values (or the --config-json file's)")]
    rows += [(f"    {p}", cmd.preset_help[p]) for p in _ordered(cmd) if p in cmd.preset_help]
    if cmd.quick:
        rows.append(("--quick", f"= --preset {cmd.quick}"))
    rows += [("--config-json FILE", "start from a saved config (a run's config.json) instead of a preset"),
             ("--set KEY=VALUE", "= --KEY VALUE, with the field's name (model.hidden_size=256); lists "
                                 "comma-separated"),
             ("--debug", "show the traceback of an error")]
    lines = [f"common flags of `poslsh {cmd.name}`:"]
    for flag, text in rows:
        if len(flag) < 22:
            lines += _wrap(text, " " * 24, f"  {flag:<21} ")
        else:       # a long flag (the preset names) on its own line
            lines += [f"  {flag}"] + _wrap(text, " " * 24)
    return "\n".join(lines)


def _take(args: List[str], flag: str) -> Optional[str]:
    """Remove ``flag VALUE`` / ``flag=VALUE`` from ``args``; the last one wins."""
    value = None
    i = 0
    while i < len(args):
        a = args[i]
        if a == flag:
            if i + 1 >= len(args):
                raise ConfigError(f"{flag} needs a value")
            value = args[i + 1]
            del args[i:i + 2]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
            del args[i]
        else:
            i += 1
    return value


def _sets_to_flags(args: List[str]) -> List[str]:
    """``--set a.b_c=1,2`` -> ``--a.b-c 1 2`` (tyro's spelling of the same field)."""
    out: List[str] = []
    i = 0
    while i < len(args):
        if args[i] == "--set" or args[i].startswith("--set="):
            if args[i] == "--set":
                if i + 1 >= len(args):
                    raise ConfigError("--set needs KEY=VALUE")
                item, i = args[i + 1], i + 2
            else:
                item, i = args[i].split("=", 1)[1], i + 1
            if "=" not in item:
                raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
            key, value = item.split("=", 1)
            out += ["--" + key.strip().replace("_", "-")] + ([p for p in value.split(",") if p] or [value])
        else:
            out.append(args[i])
            i += 1
    return out


def _flag_fields(flags: Sequence[str]) -> List[Tuple[str, str]]:
    """``(flag, field path)`` of each ``--flag`` in ``flags``: ``--model.hidden-size`` ->
    ``model.hidden_size``, ``--no-progress`` -> ``progress``."""
    out = []
    for a in flags:
        if a.startswith("--") and len(a) > 2:
            name = a[2:].split("=", 1)[0]
            out.append((f"--{name}", name.replace("-", "_")))
    return out


def _base(cmd: Command, preset: Optional[str], config_json: Optional[str]):
    if config_json is None:
        return cmd.preset(preset or cmd.default_preset)
    if preset is not None:
        raise ConfigError(f"pass one of --preset {preset} and --config-json {config_json}: the file holds a "
                          "whole configuration")
    from poslsh_paper.experiments.serialize import config_from_dict
    path = Path(config_json)
    if not path.is_file():
        raise ConfigError(f"--config-json: no such file {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config-json {path}: not UTF-8 text (byte {e.start}): pass a JSON file such as a "
                          "run's config.json") from None
    except ValueError as e:
        raise ConfigError(f"--config-json {path}: not JSON ({e}): pass a JSON file such as a run's "
                          "config.json") from None
    try:
        return config_from_dict(cmd.config, data)
    except ConfigError as e:
        raise ConfigError(f"--config-json {path}: {e}") from None


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def parse_given(cmd: Command, args: Sequence[str]):
    """``(config, given)``: the full config of ``cmd`` from its command-line ``args`` (without the
    command name), and the dotted names of the fields the flags set (``given``; the rest came
    from the preset or the ``--config-json`` file)."""
    import tyro

    args = _sets_to_flags(list(args))
    quick = "--quick" in args
    args = [a for a in args if a != "--quick"]
    preset = _take(args, "--preset")
    if quick:
        if cmd.quick is None:
            raise ConfigError(f"--quick: `poslsh {cmd.name}` has no quick preset (presets: "
                              f"{', '.join(cmd.presets)})")
        if preset not in (None, cmd.quick):
            raise ConfigError(f"--quick is --preset {cmd.quick}: pass one of --quick and --preset {preset}")
        preset = cmd.quick
    config_json = _take(args, "--config-json")
    helping = "-h" in args or "--help" in args
    for flag, name in _flag_fields(args):
        name = name[3:] if name.startswith("no_") and name[3:] in cmd.elsewhere else name
        if name in cmd.elsewhere and not helping:
            raise ConfigError(f"{flag} does nothing in `poslsh {cmd.name}`: it is a flag of "
                              f"`poslsh {cmd.elsewhere[name]}`")
    base = _base(cmd, preset, config_json)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg = tyro.cli(cmd.config, default=base, args=args, prog=f"poslsh {cmd.name}", description=cmd.help)
    except SystemExit as e:
        if e.code:      # a parse error: tyro draws a box; the user gets its one message line
            raise ConfigError(_one_line(err.getvalue(), cmd.name)) from None
        sys.stderr.write(err.getvalue())
        if helping:
            print("\n" + common_help(cmd))
        raise
    before, after = _flatten(dataclasses.asdict(base)), _flatten(dataclasses.asdict(cfg))
    given = {k for k in after if before.get(k) != after[k]}
    given |= {name[3:] if name.startswith("no_") and name[3:] in after else name
              for _, name in _flag_fields(args)} & set(after)
    return cfg, frozenset(given)


def parse(cmd: Command, args: Sequence[str]):
    """The full config of ``cmd`` from its command-line ``args`` (without the command name)."""
    return parse_given(cmd, args)[0]


def _one_line(box: str, name: str) -> str:
    """tyro's error box -> ``message (perhaps you meant --flag TYPE); see poslsh NAME --help``."""
    lines = [ln.strip(" │╭╮╰╯") for ln in box.splitlines()]
    lines = [ln for ln in lines if ln.strip("─-")]       # drop rules and blank lines
    message = lines[1] if len(lines) > 1 else (lines[0] if lines else "invalid arguments")
    hint = ""
    if "Perhaps you meant:" in lines:
        i = lines.index("Perhaps you meant:")
        if i + 1 < len(lines):
            hint = f" (perhaps you meant {lines[i + 1]})"
    return f"{message}{hint}; see `poslsh {name} --help`"


def _split_debug(argv: List[str]) -> Tuple[List[str], bool]:
    debug = "--debug" in argv
    return [a for a in argv if a != "--debug"], debug


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is, so it unwinds like Ctrl-C (checkpoints are saved)."""


def _raise_terminated(signum, frame):
    raise Terminated()


def main(argv: Optional[Sequence[str]] = None) -> int:
    if threading.current_thread() is not threading.main_thread():   # handlers live in the main thread only
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: Optional[Sequence[str]]) -> int:
    from poslsh_paper.experiments.paths import is_disk_full

    argv, debug = _split_debug(list(sys.argv[1:] if argv is None else argv))
    cmds = commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(overview(cmds))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    try:
        if name not in cmds:
            raise ConfigError(f"unknown command {name!r}; choose from {', '.join(cmds)}")
        cfg, given = parse_given(cmds[name], rest)
        return int(cmds[name].run(cfg, given) or 0)
    except KeyboardInterrupt as e:
        return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
    except ConfigError as e:
        if debug:
            raise
        print(f"poslsh {name}: error: {_flat(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        if debug or not is_disk_full(e):
            raise
        where = e.filename or "the output directory"
        print(f"poslsh {name}: error: no space left on device writing {where}; free space there or write "
              "elsewhere (--runs-dir / --out)", file=sys.stderr)
        return 2


def _flat(e: BaseException) -> str:
    """An error as one line (a library's message may hold newlines)."""
    return " ".join(str(e).split("\n"))


if __name__ == "__main__":
    sys.exit(main())
