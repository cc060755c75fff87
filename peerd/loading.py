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

import dataclasses
import functools
import json
import math
import re
import reprlib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import pydantic
import pydantic_core
import yaml

from peerd.errors import ConfigError

T = TypeVar("T")

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


# libyaml's parser when built in: 10-20x faster on big or hostile files (issue 15's fuzzing)
class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader that also reads ``1.3e9`` as a float (YAML 1.1 wants ``1.3e+9``; people don't write that)."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        # A plain scalar's tag depends on its text alone (no path resolvers here), and matrices repeat
        # a few texts thousands of times: remember them rather than run ~8 regexes on each.
        if kind is not yaml.ScalarNode or not implicit[0] or len(value) > 32:
            return super().resolve(kind, value, implicit)
        seen = self.__dict__.setdefault("_tags", {})
        tag = seen.get(value)
        if tag is None:
            tag = super().resolve(kind, value, implicit)
            if len(seen) < 4096:
                seen[value] = tag
        return tag


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
        n, where = len(self._errors), f"{source}: " if source else ""
        super().__init__("", f"{where}{n} problem{'s' * (n != 1)} in {what} [{self.code.name}]:\n{lines}")

    @property
    def errors(self) -> list[ConfigError]:
        return self._errors

    def __str__(self) -> str:
        return Exception.__str__(self)  # the code is on the first line already


MAX_PROBLEMS = 100  # problems listed per round of validation, and per list of numbers


@dataclasses.dataclass(frozen=True)
class Range:
    """Bounds of a number field, or of every number in a list field: ``Annotated[float, Range(gt=0)]``.

    Checked in round 2 (so the other problems are still found); a number must also be finite.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def problems(self, value: Any, path: str, alternatives: str = "") -> list[ConfigError]:
        """Where ``value`` (a number, or nested lists of them) is out of bounds; other values are not checked."""
        if isinstance(value, list | tuple):
            out: list[ConfigError] = []
            for i, v in enumerate(value):
                out += self.problems(v, f"{path}[{i}]")
                if len(out) >= MAX_PROBLEMS:  # a matrix of thousands of bad numbers: enough said
                    break
            return out
        if isinstance(value, bool) or not isinstance(value, int | float):
            return []
        above = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        below = (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
        if math.isfinite(value) and above and below:
            return []
        return [ConfigError(path, f"must be {self}{alternatives}, got {value!r}")]

    def __str__(self) -> str:
        lo, lo_op = (self.ge, ">=") if self.ge is not None else (self.gt, ">")
        hi, hi_op = (self.le, "<=") if self.le is not None else (self.lt, "<")
        if lo is not None and hi is not None:
            return f"in {'[' if lo_op == '>=' else '('}{lo:g}, {hi:g}{']' if hi_op == '<=' else ')'}"
        return f"{lo_op} {lo:g}" if lo is not None else f"{hi_op} {hi:g}"


# A config file is KiBs (the largest shipped scenario, dtfm-case1, is 27 KB); a 1,024-device
# scenario with full matrices stays below this.
MAX_FILE_BYTES = 64 << 20
# Values a YAML file's aliases may expand to, beyond the file's own size (issue 15): 344 bytes of
# nested anchors (``a1: &a1 [*a0, *a0, ...]``) expand to 10^6 values, which took 6 s of CPU to
# validate; one more level, 60 s and gigabytes.
MIN_VALUES_ALLOWED = 1 << 16


def expanded_size(data: Any, limit: int) -> int:
    """Values in ``data`` with every shared (aliased) part counted each time it occurs, up to ``limit + 1``.

    Linear in the distinct nodes (each node's size is computed once, without recursion: YAML nests
    up to libyaml's 1,000 levels); a structure that contains itself counts as ``limit + 1``.
    """
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        node, children_done = stack.pop()
        if not isinstance(node, dict | list) or id(node) in sizes:
            continue
        children = list(node.values()) if isinstance(node, dict) else node
        if children_done:
            on_path.discard(id(node))
            total = 1 + sum(sizes.get(id(c), 1) for c in children)
            sizes[id(node)] = min(total, limit + 1)
            continue
        if id(node) in on_path:  # reached again below itself
            return limit + 1
        on_path.add(id(node))
        stack.append((node, True))
        stack += [(c, False) for c in children if isinstance(c, dict | list) and id(c) not in sizes]
    return sizes.get(id(data), 1)


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON file whose top level is a mapping, of at most ``MAX_FILE_BYTES``, whose
    aliases expand it to no more values than its size in bytes (or ``MIN_VALUES_ALLOWED``)."""
    path = Path(path)
    try:
        if (size := path.stat().st_size) > MAX_FILE_BYTES:
            raise ConfigError(str(path), f"{size} bytes: larger than a config file may be ({MAX_FILE_BYTES})")
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), f"not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    kind = "JSON" if path.suffix == ".json" else "YAML"
    try:
        data = json.loads(text) if kind == "JSON" else yaml.load(text, Loader=_Loader)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), f"not valid {kind}: {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # constructors, e.g. a bad date
        raise ConfigError(str(path), f"not valid {kind}: {type(exc).__name__}: {exc}"[:500]) from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"top level must be a mapping, got {type(data).__name__}")
    allowed = max(len(text), MIN_VALUES_ALLOWED)
    if kind == "YAML" and expanded_size(data, allowed) > allowed:
        raise ConfigError(
            str(path),
            f"its aliases expand it to over {allowed} values, or it contains itself",
        )
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
    obj, errors, broken = _parse(cls, data, path)
    errors += _checks(cls, data, path, obj, broken)
    return obj, list({(e.field, e.detail): e for e in errors}.values())


def _checks(
    cls: Any, data: Any, path: str, obj: Any, broken: set[tuple[str, ...]], at: tuple[str, ...] = ()
) -> list[ConfigError]:
    """Round 2 on ``obj`` built from ``data``, or if it is None, on each dataclass-typed field that can be built.

    ``broken``: the field paths (from ``at``, the top) round 1 found a wrong value in or below; a
    field among them cannot be built, so it is not parsed again (thousands of bad items cost
    milliseconds per parse), only searched for fields below it that can."""
    if obj is not None:
        return problems(obj, path)
    out: list[ConfigError] = []
    if dataclasses.is_dataclass(cls) and isinstance(data, dict):
        for name, tp in get_type_hints(cls).items():
            if dataclasses.is_dataclass(sub := _bare(tp)) and isinstance(value := data.get(name), dict):
                here = (*at, name)
                built = None if here in broken else _parse(sub, value, path)[0]
                out += _checks(sub, value, _join(path, name), built, broken, here)
    return out


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
        for p in rng.problems(getattr(obj, name), _join(path, name), alternatives)
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


@functools.cache
def _ranges(cls: type) -> dict[str, tuple[Range, str]]:
    """Each ``Range``-annotated field of ``cls``, with the text naming the other values it may take."""
    out = {}
    for name, hint in get_type_hints(cls, include_extras=True).items():
        rng = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Range)), None)
        if rng is not None:
            options = get_args(get_args(hint)[0]) or (get_args(hint)[0],)
            others = [repr(v) for o in options if get_origin(o) is Literal for v in get_args(o)]
            others += ["null"] * (type(None) in options)
            out[name] = (rng, "".join(f" or {o}" for o in others))
    return out


# --- round 1: pydantic, its errors in our words -------------------------------------------------


@functools.cache
def _edge(cls: type, extra: Literal["forbid", "ignore"]) -> Any:
    """A model holding one ``cls`` as ``value``: its config (strict, ``extra``) reaches every dataclass inside."""
    config = pydantic.ConfigDict(strict=True, extra=extra, allow_inf_nan=False)
    return pydantic.create_model(f"{cls.__name__}FromMapping", __config__=config, value=(cls, ...))


def _parse(cls: Any, data: Any, path: str) -> tuple[Any, list[ConfigError], set[tuple[str, ...]]]:
    """Round 1: ``(object or None, its errors, broken)``; where only keys are unknown, the object built
    without them. ``broken``: every chain of keys (stopping at the first list index) leading to a
    value of the wrong type or a missing one (unknown keys break nothing)."""
    try:
        text = pydantic_core.to_json({"value": data}, inf_nan_mode="constants")
    except pydantic_core.PydanticSerializationError as exc:
        return None, [ConfigError(path, f"holds a value YAML and JSON cannot: {exc}")], {()}
    errors: list[ConfigError] = []
    broken: set[tuple[str, ...]] = set()
    for extra in ("forbid", "ignore"):
        try:
            return _edge(cls, extra).model_validate_json(text).value, errors, broken
        except pydantic.ValidationError as exc:
            found = exc.errors(include_url=False)
        errors += _translate(cls, found[:MAX_PROBLEMS], path)
        if len(found) > MAX_PROBLEMS:  # a hostile or broken file can hold thousands: list what a person reads
            errors.append(ConfigError(path, f"... and {len(found) - MAX_PROBLEMS} more problems"))
        for e in found:
            if e["type"] not in _UNKNOWN:
                broken.update(_key_chains(e["loc"][1:]))
        if broken:
            break
    return None, errors, broken


def _key_chains(loc: tuple[int | str, ...]) -> Iterator[tuple[str, ...]]:
    """``()``, then each longer run of ``loc``'s leading keys, up to its first list index."""
    chain: tuple[str, ...] = ()
    yield chain
    for key in loc:
        if not isinstance(key, str):
            return
        chain = (*chain, key)
        yield chain


def _translate(cls: Any, found: list[Any], path: str) -> list[ConfigError]:
    """pydantic's errors in our words; a union gets one error, saying what each of its members wants."""
    errors: list[tuple[str, str]] = []
    unions: dict[str, list[str]] = {}
    for e in found:
        where, parent, at_union = _locate(cls, e["loc"][1:])
        if at_union and where not in unions:
            errors.append((where, e["input"]))
        if at_union:
            unions.setdefault(where, []).append(_want(e))
        else:
            errors += _details(e, where, parent)
    return [
        ConfigError(_join(path, f), _wrong(" or ".join(unions[f]), d) if f in unions else d)
        for f, d in errors
    ]


def _details(e: Any, where: str, parent: Any) -> list[tuple[str, str]]:
    """``(field, detail)`` of one pydantic error found at ``where``, a key or item of type ``parent``."""
    error = e.get("ctx", {}).get("error")
    if isinstance(error, ConfigError):  # raised by a dataclass's __post_init__
        return [(p.field, p.detail) for p in (prefixed(where, x) for x in error.errors)]
    if e["type"] in _UNKNOWN:
        return [(where, f"unknown key (allowed: {', '.join(f.name for f in dataclasses.fields(parent))})")]
    if e["type"] == "missing" and get_origin(parent) is tuple:  # one per missing item; collect() keeps one
        n = len(get_args(parent))
        return [(where.rpartition("[")[0], f"must have exactly {n} items, got {len(e['input'])}")]
    if e["type"] == "too_long" and e["ctx"]["field_type"] == "Tuple":
        return [(where, f"must have exactly {e['ctx']['max_length']} items, got {e['ctx']['actual_length']}")]
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


def _locate(tp: Any, loc: tuple[Any, ...]) -> tuple[str, Any, bool]:
    """Dotted path of pydantic's ``loc`` in type ``tp``: ``(path, type of its parent, stops at a union)``.

    A union's errors carry a tag per member after its location; the path stops before them.
    """
    path, parent = "", None
    for key in loc:
        tp = _bare(tp)
        if get_origin(tp) in (Union, types.UnionType):
            return path, parent, True
        parent, args = tp, [a for a in get_args(tp) if a is not Ellipsis]
        path = _join(path, f"[{key}]" if isinstance(key, int) else key)
        if dataclasses.is_dataclass(tp):
            tp = _type_hints(tp).get(key, Any)  # type: ignore[arg-type]
        elif get_origin(tp) is tuple and Ellipsis not in get_args(tp):  # fixed length: a type per item
            tp = args[key] if key < len(args) else Any
        else:  # list, tuple[X, ...], dict: the type of every item or value
            tp = args[-1] if args else Any
    return path, parent, False


@functools.cache
def _type_hints(cls: Any) -> dict[str, Any]:
    """``get_type_hints`` once per class: it compiles every annotation, ~1 ms a call, and a file with
    thousands of bad items asks once per item (a fuzzed scenario took 8 s before this)."""
    return get_type_hints(cls)


def _bare(tp: Any) -> Any:
    """``tp`` without ``Annotated`` and, if it is ``X | None``, without the ``None``."""
    if get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if len(options) == 1:
            return _bare(options[0])
    return tp


def _join(path: str, key: str) -> str:
    return f"{path}{key}" if key.startswith("[") or not path else f"{path}.{key}"
