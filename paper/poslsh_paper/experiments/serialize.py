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


def _wrong(name: str, want: str, value) -> ConfigError:
    return ConfigError(f"{name}: expected {want}, got {value!r}")


def _convert(tp, value, name: str):
    """``value`` (from JSON) as type ``tp``, or a :class:`ConfigError` naming the field."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _wrong(name, f"a {tp.__name__} object", value)
        return config_from_dict(tp, value, prefix=f"{name}.")
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            if len(args) == len(typing.get_args(tp)):
                raise _wrong(name, "a value", value)
            return None
        return _convert(args[0], value, name) if len(args) == 1 else value
    if origin in (tuple, typing.Tuple):
        if not isinstance(value, (list, tuple)):
            raise _wrong(name, "a list", value)
        args = typing.get_args(tp)
        item = args[0] if args else Any
        return tuple(_convert(item, v, f"{name}[{i}]") for i, v in enumerate(value))
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise _wrong(name, f"one of {list(typing.get_args(tp))}", value)
        return value
    if tp is bool and not isinstance(value, bool):
        raise _wrong(name, "true or false", value)
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise _wrong(name, "an integer", value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _wrong(name, "a number", value)
        return float(value)
    if tp is str and not isinstance(value, str):
        raise _wrong(name, "a string", value)
    return value


def config_from_dict(config_type: type, data: Dict[str, Any], prefix: str = ""):
    """Inverse of :func:`config_to_dict`; an unknown key or a value of the wrong type is a
    :class:`ConfigError` naming the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"a {config_type.__name__} must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(config_type)
    fields = {f.name for f in dataclasses.fields(config_type) if f.init}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"unknown {config_type.__name__} field(s) {[prefix + u for u in unknown]}; known: "
                          f"{sorted(fields)}")
    return config_type(**{k: _convert(hints[k], v, prefix + k) for k, v in data.items()})


def config_fingerprint(cfg, exclude=()) -> str:
    """16 hex digits of the SHA-256 of the config's JSON (keys sorted; ``exclude`` dropped)."""
    d = {k: v for k, v in config_to_dict(cfg).items() if k not in exclude}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
