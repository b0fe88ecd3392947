"""Config dataclasses to and from JSON-able dicts (nested dataclasses, tuples),
and a fingerprint that identifies a config's content."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from typing import Any, Dict

from poslsh_paper.experiments.command import ConfigError

__all__ = ["config_to_dict", "config_from_dict", "config_fingerprint"]


def config_to_dict(cfg) -> Dict[str, Any]:
    """``asdict`` with tuples as lists: exactly what ``json.dumps`` writes."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _convert(tp, value):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return config_from_dict(tp, value)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _convert(args[0], value) if len(args) == 1 else value
    if origin in (tuple, typing.Tuple) and isinstance(value, list):
        args = typing.get_args(tp)
        item = args[0] if args else Any
        return tuple(_convert(item, v) for v in value)
    return value


def config_from_dict(config_type: type, data: Dict[str, Any]):
    """Inverse of :func:`config_to_dict`; an unknown key is a :class:`ConfigError`
    (extra keys of a subclass, such as run options, are dropped when loading a base config)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a {config_type.__name__} must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(config_type)
    fields = {f.name for f in dataclasses.fields(config_type) if f.init}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"unknown {config_type.__name__} field(s) {unknown}; known: {sorted(fields)}")
    return config_type(**{k: _convert(hints[k], v) for k, v in data.items()})


def config_fingerprint(cfg, exclude=()) -> str:
    """16 hex digits of the SHA-256 of the config's JSON (keys sorted; ``exclude`` dropped)."""
    d = {k: v for k, v in config_to_dict(cfg).items() if k not in exclude}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
