"""Turn YAML/JSON files and plain mappings into typed, validated dataclasses.

The one place that parses configuration files. Every component owns its config
dataclasses; this module only fills them: unknown keys, missing required
fields and wrong types raise ``ConfigError`` naming the dotted field path.
A dataclass may define ``validate(self) -> None`` for cross-field checks; it is
called after the fields are filled (raise ``ConfigError`` from it).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from peerd.errors import ConfigError

T = TypeVar("T")


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1.3e9`` as a float (YAML 1.1 wants ``1.3e+9``; people don't write that)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$|^[-+]?\d[\d_]*\.\d*$|^[-+]?\.\d+$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON file whose top level is a mapping."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read file: {exc.strerror or exc}") from None
    try:
        data = (
            json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_Loader)
        )  # a SafeLoader subclass
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            str(path), f"not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"top level must be a mapping, got {type(data).__name__}")
    return data


def from_mapping(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, validating types and rejecting unknown keys."""
    return _convert(cls, data, path)  # Any to mypy; _convert_dataclass builds a cls


def load_dataclass(cls: type[T], file: str | Path) -> T:
    """``from_mapping(cls, load_mapping(file))``."""
    return from_mapping(cls, load_mapping(file))


def to_mapping(obj: Any) -> Any:
    """Inverse of ``from_mapping`` for dataclasses, enums and containers (JSON/YAML-safe)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {k: to_mapping(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_mapping(v) for v in obj]
    return obj


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(path, "must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(path, f"{value!r} matches none of the allowed types ({'; '.join(errors)})")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(path, f"must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            members = ", ".join(repr(m.value) for m in tp)
            raise ConfigError(path, f"must be one of {members}, got {value!r}") from None
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"must be a list, got {type(value).__name__}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(path, f"must have exactly {len(args)} items, got {len(value)}")
            return tuple(
                _convert(a, v, _join(path, i)) for i, (a, v) in enumerate(zip(args, value, strict=True))
            )
        item = args[0] if args else Any
        items = [_convert(item, v, _join(path, i)) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"must be a mapping, got {type(value).__name__}")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {_convert(key_tp, k, path): _convert(val_tp, v, _join(path, str(k))) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"must be a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {value!r}")
        return value
    if tp is Path:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a path string, got {value!r}")
        return Path(value)
    raise TypeError(f"loading: unsupported field type {tp!r} at {path or '<root>'}")


def _convert_dataclass(cls: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(value) and isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ConfigError(path, f"must be a mapping, got {type(value).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise ConfigError(
            _join(path, str(unknown[0])),
            f"unknown key (allowed: {', '.join(sorted(fields))})",
        )
    kwargs = {}
    for name, field in fields.items():
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], _join(path, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(path, name), "is required")
    try:
        obj = cls(**kwargs)
        validate = getattr(obj, "validate", None)
        if callable(validate):
            validate()
    except ConfigError as exc:
        # Field paths raised inside a nested dataclass are relative to it: prefix ours.
        if path and exc.field and not exc.field.startswith(path):
            raise ConfigError(_join(path, exc.field), _bare_message(exc)) from None
        raise
    return obj


def _bare_message(exc: ConfigError) -> str:
    """The message of ``exc`` without its field prefix and code suffix."""
    text = Exception.__str__(exc)
    prefix = f"{exc.field}: "
    return text[len(prefix) :] if text.startswith(prefix) else text
