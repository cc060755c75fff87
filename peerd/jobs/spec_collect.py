"""Build a dataclass from a mapping one field at a time, so every bad field is reported, not the first.

``peerd.loading.from_mapping`` stops at the first mistake, which is right for most configs;
a job spec is written by hand and refused remotely, so ``peerd submit`` lists all of them.
Each leaf value still goes through ``from_mapping`` (same conversions, same messages).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, get_type_hints

from peerd.errors import ConfigError
from peerd.loading import from_mapping


def collect(cls: type, data: Any, path: str = "", *, check: bool = True) -> tuple[Any, list[ConfigError]]:
    """``(object, errors)``: the object is built whenever every field converted, else None.

    Unknown keys are errors but do not stop the rest. Dataclass-typed fields recurse. With
    ``check``, a built object's own ``problems()`` (a list) or ``validate()`` (raises) run
    and add to the errors, field names prefixed with ``path``.
    """
    if not isinstance(data, dict):
        return None, [ConfigError(path, f"must be a mapping, got {type(data).__name__}")]
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    allowed = ", ".join(sorted(fields))
    errors = [
        ConfigError(_join(path, str(k)), f"unknown key (allowed: {allowed})") for k in data if k not in fields
    ]
    converted = True
    values: dict[str, Any] = {}
    for name, f in fields.items():
        where = _join(path, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                errors.append(ConfigError(where, "is required"))
                converted = False
            continue
        tp = hints[name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            obj, errs = collect(tp, data[name], where)
        else:
            try:
                obj, errs = (
                    getattr(from_mapping(_one_field(cls, name, tp), {name: data[name]}, path), name),
                    [],
                )
            except ConfigError as exc:
                obj, errs = None, [exc]
        errors += errs
        converted = converted and not (obj is None and data[name] is not None)
        values[name] = obj
    if not converted:
        return None, errors
    obj = cls(**values)
    if check:
        errors += [prefixed(path, p) for p in _own_problems(obj)]
    return obj, errors


def bare_message(exc: Exception) -> str:
    """A ConfigError's message without its ``field: `` prefix."""
    text = Exception.__str__(exc)
    name = getattr(exc, "field", "")
    return text.removeprefix(f"{name}: ") if name else text


def _own_problems(obj: Any) -> list[ConfigError]:
    problems = getattr(obj, "problems", None)
    if callable(problems):
        return list(problems())
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as exc:
            return [exc]
    return []


@functools.cache
def _one_field(cls: type, name: str, tp: Any) -> type:
    """A one-field dataclass, so ``from_mapping`` converts a single value with its usual rules."""
    return dataclasses.make_dataclass(f"{cls.__name__}_{name}", [(name, tp)])


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def prefixed(path: str, exc: ConfigError) -> ConfigError:
    """``exc`` with its field placed under ``path``."""
    return ConfigError(_join(path, exc.field) if exc.field else path, bare_message(exc))
