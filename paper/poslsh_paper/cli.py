"""The ``poslsh`` command: every subcommand generated from a job's config dataclass.

``poslsh <command> [--preset NAME] [--config-json FILE] [--FIELD VALUE ...]``: flags are
built by tyro from the command's config dataclass (see
:class:`poslsh_paper.experiments.command.Command`); ``--set key=value`` is kept as an alias
of ``--key value`` (``--set model.hidden_size=256``, lists comma-separated), and
``--quick`` of ``--preset quick``. Errors in the configuration print one line and
exit with code 2 (``--debug`` shows the traceback); Ctrl-C exits with 130. SIGTERM (``kill``,
batch schedulers) is handled like Ctrl-C (a training run saves its checkpoint) and exits with 143:
a job started in the background by a script ignores SIGINT, so SIGTERM is how it is stopped.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from poslsh_paper.experiments.command import Command, ConfigError

__all__ = ["COMMAND_MODULES", "commands", "main", "overview"]

# Modules that define subcommands: each exposes ``COMMANDS``, a list of Command.
COMMAND_MODULES = [
    "poslsh_paper.experiments.demo",
    "poslsh_paper.experiments.bounds",
    "poslsh_paper.experiments.convergence",
    "poslsh_paper.experiments.audit",
    "poslsh_paper.experiments.lm.commands",
    "poslsh_paper.experiments.generate",
    "poslsh_paper.experiments.vision",
    "poslsh_paper.experiments.frontier",
]


def commands() -> Dict[str, Command]:
    out: Dict[str, Command] = {}
    for name in COMMAND_MODULES:
        for cmd in importlib.import_module(name).COMMANDS:
            out[cmd.name] = cmd
    return out


def overview(cmds: Dict[str, Command]) -> str:
    width = max(map(len, cmds))
    lines = ["usage: poslsh COMMAND [--preset NAME] [--FIELD VALUE ...]   (poslsh COMMAND --help for the flags)",
             "", "Positional-LSH attention tools. Commands:"]
    lines += [f"  {name:<{width}}  {cmd.help}" for name, cmd in cmds.items()]
    lines += ["", "Common flags: --preset NAME, --config-json FILE (a run's config.json), --set KEY=VALUE, "
              "--debug (show tracebacks)."]
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


def parse(cmd: Command, args: Sequence[str]):
    """The full config of ``cmd`` from its command-line ``args`` (without the command name)."""
    import tyro

    args = list(args)
    if "--quick" in args and "quick" in cmd.presets:
        args.remove("--quick")
        args += ["--preset", "quick"]
    preset = _take(args, "--preset")
    config_json = _take(args, "--config-json")
    if config_json is not None:
        from poslsh_paper.experiments.serialize import config_from_dict
        path = Path(config_json)
        if not path.is_file():
            raise ConfigError(f"--config-json: no such file {path}")
        base = config_from_dict(cmd.config, json.loads(path.read_text()))
    else:
        base = cmd.preset(preset or cmd.default_preset)
    flags = _sets_to_flags(args)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(cmd.config, default=base, args=flags, prog=f"poslsh {cmd.name}", description=cmd.help)
    except SystemExit as e:
        if e.code:      # a parse error: tyro draws a box; the user gets its one message line
            raise ConfigError(_one_line(err.getvalue(), cmd.name)) from None
        sys.stderr.write(err.getvalue())
        raise


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
    argv, debug = _split_debug(list(sys.argv[1:] if argv is None else argv))
    cmds = commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(overview(cmds))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    try:
        if name not in cmds:
            raise ConfigError(f"unknown command {name!r}; choose from {', '.join(cmds)}")
        cfg = parse(cmds[name], rest)
        return int(cmds[name].main(cfg) or 0)
    except KeyboardInterrupt as e:
        return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
    except ConfigError as e:
        if debug:
            raise
        print(f"poslsh {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
