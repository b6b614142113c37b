"""Typed config loading: plain dicts (from YAML) -> frozen dataclasses, in one place.

:func:`build` walks a dataclass's fields, converts values by their annotations and rejects
unknown keys with the key path and the valid choices (vidur/desmod style). Field help text
lives in ``field(metadata={"help": ...})``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from moesim.errors import MoesimError, did_you_mean

T = TypeVar("T")



def yaml_name(f: dataclasses.Field[Any]) -> str:
    """The key a field has in YAML (``metadata['yaml']``, e.g. ``import``; else its name)."""
    return str(f.metadata.get("yaml", f.name))


def help_of(f: dataclasses.Field[Any]) -> str:
    """The help text of a dataclass field ('' when none)."""
    return str(f.metadata.get("help", ""))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class ConfigError(MoesimError):
    """A config value or key is wrong; the message names the file and key path."""


def _err(where: str, path: str, msg: str) -> ConfigError:
    loc = f"{where}: " if where else ""
    return ConfigError(f"{loc}key '{path}' {msg}")


def convert(tp: Any, value: Any, path: str, where: str) -> Any:
    """Convert ``value`` to annotation ``tp``; raise :class:`ConfigError` naming ``path``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors: list[ConfigError] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(arg, value, path, where)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise _err(where, path, f"has an invalid value {value!r}.")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise _err(where, path, f"is {value!r}{did_you_mean(str(value), [str(c) for c in choices])}; "
                       f"valid choices: {', '.join(map(str, choices))}.")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, where)  # type: ignore[arg-type]
    if origin is dict:
        key_tp, val_tp = get_args(tp)
        if not isinstance(value, dict):
            raise _err(where, path, f"must be a mapping, got {type(value).__name__} {value!r}.")
        return {convert(key_tp, k, _join(path, str(k)), where): convert(val_tp, v, _join(path, str(k)), where)
                for k, v in value.items()}
    if origin in (list, tuple):
        (item_tp, *_) = get_args(tp) or (Any,)
        if not isinstance(value, list | tuple):
            raise _err(where, path, f"must be a list, got {value!r}.")
        items = [convert(item_tp, v, f"{path}[{i}]", where) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if not isinstance(value, bool):
            raise _err(where, path, f"must be true or false, got {value!r}.")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _err(where, path, f"must be an integer, got {value!r}.")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _err(where, path, f"must be a number, got {value!r}.")
        if math.isnan(float(value)):
            raise _err(where, path, "must be a number, got NaN.")
        return float(value)
    if tp is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise _err(where, path, f"must be a string, got {value!r}.")
        return str(value)
    return value


def build(cls: type[T], data: Any, path: str = "", where: str = "") -> T:
    """Build dataclass ``cls`` from mapping ``data``; unknown keys are errors."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _err(where, path or "<top>", f"must be a mapping of keys to values, got {data!r}.")
    fields = {yaml_name(f): f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    hints = get_type_hints(cls)
    unknown = [k for k in data if k not in fields]
    if unknown:
        bad = str(unknown[0])
        raise _err(where, _join(path, bad),
                   f"is not a known key{did_you_mean(bad, list(fields))}; valid keys here: "
                   f"{', '.join(fields)}.")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[f.name] = convert(hints[f.name], data[name], _join(path, name), where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _err(where, _join(path, name), f"is required ({help_of(f)}).")
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise _err(where, path or "<top>", f"is invalid: {exc}") from None


def to_plain(obj: Any) -> Any:
    """Dataclasses -> dicts recursively (for the resolved scenario YAML)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            if f.metadata.get("internal") or (f.metadata.get("omit_none") and getattr(obj, f.name) is None):
                continue
            out[yaml_name(f)] = to_plain(getattr(obj, f.name))
        return out
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_plain(v) for v in obj]
    return obj


def describe_fields(cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, help) of each field of a dataclass, for listings."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default: Any = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        elif f.default is dataclasses.MISSING:
            default = "(required)"
        tp = hints[f.name]
        rows.append((yaml_name(f), getattr(tp, "__name__", str(tp)), default, help_of(f)))
    return rows
