"""Turn YAML/JSON files and plain mappings into typed config dataclasses, reporting every mistake at once.

The one place that parses configuration. Each component owns its config dataclasses (plain
``dataclass``es, one docstring per field); ``from_mapping`` fills them with pydantic v2 in strict
JSON mode: a value fills a field only as it would from JSON (a string fills a ``Path`` or an enum,
a list a tuple), never by coercion (a bool is no integer, a string no number, null fills only an
optional field, and no number is infinite or NaN). Every problem is a ``ConfigError`` naming its
dotted field path (``links[0].bandwidth_mbps``), found in two rounds and reported together:

1. types, required fields and unknown keys (pydantic); unknown keys alone do not stop round 2.
2. Once every value has its type, the checks of each dataclass inside, inner ones first: the
   bounds of its ``Range``-annotated fields, then its own ``problems()`` (returns a list; runs
   even where a bound failed, so it must not divide by a field it has not checked) or else
   ``validate()`` (raises the first; runs only when nothing in or below it failed).
   A dataclass-typed field is checked even when its siblings' values have the wrong type.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import re
import reprlib
import types
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import pydantic
import pydantic_core
import yaml

from peerd.errors import ConfigError

T = TypeVar("T")

_STRICT = pydantic.ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
_UNKNOWN = {"unexpected_keyword_argument", "extra_forbidden"}
_WANTS = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping",
    "dataclass_type": "a mapping",
    "finite_number": "a finite number",
    "path_type": "a path string",
}


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1.3e9`` as a float (YAML 1.1 wants ``1.3e+9``; people don't write that)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$|^[-+]?\d[\d_]*\.\d*$|^[-+]?\.\d+$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"
    ),
    list("-+0123456789."),
)


class ConfigProblems(ConfigError):
    """Several problems found at once; ``errors`` holds each one (dotted ``field`` and ``detail``)."""

    def __init__(self, errors: list[ConfigError], what: str = "the config", source: str = "") -> None:
        self._errors = [single for exc in errors for single in exc.errors]
        lines = "\n".join(f"  - {e.field or '<top level>'}: {e.detail}" for e in self._errors)
        n = len(self._errors)
        where = f"{source}: " if source else ""
        super().__init__("", f"{where}{n} problem{'s' * (n != 1)} in {what} [{self.code.name}]:\n{lines}")

    @property
    def errors(self) -> list[ConfigError]:
        return self._errors

    def __str__(self) -> str:
        return Exception.__str__(self)  # the code is on the first line already


@dataclasses.dataclass(frozen=True)
class Range:
    """Bounds of a number field, or of every number in a list field: ``Annotated[float, Range(gt=0)]``.

    Checked in round 2 (so the other problems are still found); a number must also be finite.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def holds(self, x: float) -> bool:
        below = (self.ge is not None and x < self.ge) or (self.gt is not None and x <= self.gt)
        above = (self.le is not None and x > self.le) or (self.lt is not None and x >= self.lt)
        return math.isfinite(x) and not below and not above

    def __str__(self) -> str:
        lo, lo_open = (self.ge, False) if self.ge is not None else (self.gt, True)
        hi, hi_open = (self.le, False) if self.le is not None else (self.lt, True)
        if lo is not None and hi is not None:
            return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        if lo is not None:
            return f"{'>' if lo_open else '>='} {lo:g}"
        return f"{'<' if hi_open else '<='} {hi:g}"


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON file whose top level is a mapping."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read file: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.load(text, Loader=_Loader)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            str(path), f"not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"top level must be a mapping, got {type(data).__name__}")
    return data


def from_mapping(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; raises every problem (``check``)."""
    obj, errors = collect(cls, data, path)
    check(errors, cls.__name__)
    assert obj is not None
    return obj


def load_dataclass(cls: type[T], file: str | Path) -> T:
    """``from_mapping(cls, load_mapping(file))``."""
    return from_mapping(cls, load_mapping(file))


def to_mapping(obj: Any) -> Any:
    """Inverse of ``from_mapping``: dataclasses become mappings, enums values, paths strings, tuples lists."""
    return pydantic_core.to_jsonable_python(obj)


def check(errors: list[ConfigError], what: str = "the config") -> None:
    """Raise ``errors``, if any: one as itself, several as one ``ConfigProblems``."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigProblems(errors, what)


def collect(cls: type[T], data: Any, path: str = "") -> tuple[T | None, list[ConfigError]]:
    """Both rounds: ``(object, every problem)``; the object is None where some value has the wrong type."""
    obj, first, second = _collect(cls, data, path)
    return obj, list({(e.field, e.detail): e for e in first + second}.values())


def _collect(cls: type[T], data: Any, path: str) -> tuple[T | None, list[ConfigError], list[ConfigError]]:
    obj, first, unknown = _parse(cls, data, path)
    if obj is None and unknown:  # drop the unknown keys (reported already) to check the rest
        data = copy.deepcopy(data)
        for *parents, key in unknown:
            node = data
            for k in parents:
                node = node[k]
            del node[key]
        obj, more, _ = _parse(cls, data, path)
        first += more
    if obj is not None:
        return obj, first, problems(obj, path)
    # Round 2 still checks each dataclass-typed field whose own values all have their types.
    second = []
    if dataclasses.is_dataclass(cls) and isinstance(data, dict):
        for name, tp in get_type_hints(cls).items():
            if dataclasses.is_dataclass(_bare(tp)) and isinstance(data.get(name), dict):
                second += _collect(_bare(tp), data[name], _join(path, name))[2]
    return None, first, second


def problems(obj: Any, path: str = "") -> list[ConfigError]:
    """Round 2 on a built object: the problems of every dataclass in ``obj``, inner ones first."""
    if isinstance(obj, list | tuple):
        return [p for i, v in enumerate(obj) for p in problems(v, f"{path}[{i}]")]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in problems(v, _join(path, str(k)))]
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return []
    inner = [p for f in dataclasses.fields(obj) for p in problems(getattr(obj, f.name), _join(path, f.name))]
    bounds = [
        p
        for name, (rng, alternatives) in _ranges(type(obj)).items()
        for p in _outside(rng, getattr(obj, name), _join(path, name), alternatives)
    ]
    own: list[ConfigError] = []
    if callable(getattr(obj, "problems", None)):
        own = list(obj.problems())  # type: ignore[attr-defined]
    elif not inner and not bounds and callable(getattr(obj, "validate", None)):
        try:
            obj.validate()  # type: ignore[attr-defined]
        except ConfigError as exc:
            own = exc.errors
    return inner + bounds + [prefixed(path, p) for p in own]


def prefixed(path: str, exc: ConfigError) -> ConfigError:
    """``exc`` with its field placed under ``path``."""
    return ConfigError(_join(path, exc.field) if exc.field else path, exc.detail)


# --- round 1: pydantic, its errors in our words -------------------------------------------------


_EDGES: dict[type, Any] = {}


def _edge(cls: type) -> Any:
    """A model holding one ``cls`` as ``value``: its config (strict, no extra keys) reaches every dataclass inside."""
    if cls not in _EDGES:
        _EDGES[cls] = pydantic.create_model(
            f"{cls.__name__}FromMapping", __config__=_STRICT, value=(cls, ...)
        )
    return _EDGES[cls]


def _parse(cls: type[T], data: Any, path: str) -> tuple[T | None, list[ConfigError], list[Any]]:
    """Round 1: ``(object or None, its errors, where the unknown keys are if nothing else is wrong)``."""
    try:
        text = pydantic_core.to_json({"value": data}, inf_nan_mode="constants")
    except pydantic_core.PydanticSerializationError as exc:
        return None, [ConfigError(path, f"holds a value YAML and JSON cannot: {exc}")], []
    try:
        return _edge(cls).model_validate_json(text).value, [], []
    except pydantic.ValidationError as exc:
        found = exc.errors(include_url=False)
    errors: list[tuple[str, str]] = []
    unions: dict[str, list[str]] = {}  # one error per union, saying what each member wants
    for e in found:
        where, tp, parent, at_union = _locate(cls, e["loc"][1:])
        if at_union and where not in unions:
            errors.append((where, e["input"]))
        if at_union:
            unions.setdefault(where, []).append(_want(e))
        else:
            errors += _details(e, where, tp, parent)
    out = [
        ConfigError(_join(path, f), _wrong(" or ".join(unions[f]), d) if f in unions else d)
        for f, d in errors
    ]
    unknown = [e["loc"][1:] for e in found if e["type"] in _UNKNOWN]
    return None, out, unknown if len(unknown) == len(found) else []


def _details(e: Any, where: str, tp: Any, parent: Any) -> list[tuple[str, str]]:
    """``(field, detail)`` of one pydantic error found at ``where``, of type ``tp`` inside ``parent``."""
    error = e.get("ctx", {}).get("error")
    if isinstance(error, ConfigError):  # raised by a dataclass's __post_init__
        return [(p.field, p.detail) for p in (prefixed(where, x) for x in error.errors)]
    if e["type"] in _UNKNOWN:
        return [(where, f"unknown key (allowed: {', '.join(f.name for f in dataclasses.fields(parent))})")]
    if e["type"] == "missing" and get_origin(parent) is tuple:
        return [(where.rpartition("[")[0], _length(parent, e["input"]))]
    if e["type"] == "too_long" and get_origin(tp) is tuple:
        return [(where, _length(tp, e["input"]))]
    if e["type"] == "missing":
        return [(where, "is required")]
    return [(where, str(error) if error is not None else _wrong(_want(e), e["input"]))]


def _want(e: Any) -> str:
    if e["type"] in ("literal_error", "enum"):
        return f"one of {e['ctx']['expected']}"
    return _WANTS.get(e["type"]) or e["msg"].removeprefix("Input should be ")


def _wrong(want: str, value: Any) -> str:
    if value is None:
        return "must not be null"
    got = type(value).__name__ if isinstance(value, dict | list) else reprlib.repr(value)
    return f"must be {want}, got {got}"


def _length(tp: Any, value: Any) -> str:
    return f"must have exactly {len(get_args(tp))} items, got {len(value)}"


def _locate(tp: Any, loc: tuple[Any, ...]) -> tuple[str, Any, Any, bool]:
    """Dotted path of pydantic's ``loc`` in type ``tp``: ``(path, type there, its parent's, stops at a union)``.

    A union's errors carry a tag per member after its location; the path stops before them.
    """
    path, parent = "", None
    for key in loc:
        tp = _bare(tp)
        if get_origin(tp) in (Union, types.UnionType):
            return path, tp, parent, True
        parent, args = tp, get_args(tp)
        if isinstance(key, int):
            path += f"[{key}]"
            fixed = get_origin(tp) is tuple and Ellipsis not in args
            tp = (args[key] if key < len(args) else Any) if fixed else (args[0] if args else Any)
        else:
            path = _join(path, key)
            if dataclasses.is_dataclass(tp):
                tp = get_type_hints(tp).get(key, Any)
            else:
                tp = args[1] if get_origin(tp) is dict and args else Any
    return path, _bare(tp), parent, False


def _bare(tp: Any) -> Any:
    """``tp`` without ``Annotated`` and, if it is ``X | None``, without the ``None``."""
    if get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if len(options) == 1:
            return _bare(options[0])
    return tp


# --- round 2: bounds ---------------------------------------------------------------------------


@functools.cache
def _ranges(cls: type) -> dict[str, tuple[Range, str]]:
    """Each ``Range``-annotated field of ``cls``, with the text naming the other values it may take."""
    out = {}
    for name, hint in get_type_hints(cls, include_extras=True).items():
        if get_origin(hint) is not Annotated:
            continue
        rng = next((m for m in hint.__metadata__ if isinstance(m, Range)), None)
        if rng is None:
            continue
        options = get_args(get_args(hint)[0]) or (get_args(hint)[0],)
        others = [repr(v) for o in options if get_origin(o) is Literal for v in get_args(o)]
        others += ["null"] * (type(None) in options)
        out[name] = (rng, "".join(f" or {o}" for o in others))
    return out


def _outside(rng: Range, value: Any, path: str, alternatives: str) -> list[ConfigError]:
    if isinstance(value, list | tuple):
        return [p for i, v in enumerate(value) for p in _outside(rng, v, f"{path}[{i}]", "")]
    if isinstance(value, bool) or not isinstance(value, int | float) or rng.holds(value):
        return []
    return [ConfigError(path, f"must be {rng}{alternatives}, got {value!r}")]


def _join(path: str, key: str) -> str:
    return f"{path}{key}" if key.startswith("[") or not path else f"{path}.{key}"
