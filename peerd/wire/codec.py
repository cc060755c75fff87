"""The canonical encoder and the bounded decoder every peerd message goes through.

Canonical form (``protocols/README.md``): msgpack maps with str keys in sorted order, struct
fields under their wire names, floats as float64, ints in their shortest form, ``bin`` for
bytes, no extension types, absent optional fields omitted. One value has exactly one byte
string, which is what signatures and digests cover.

Every decoding failure is a ``ProtocolError`` whose message names the field
(``what: a.b[2].c: why``): OVERSIZED for anything longer than its declared limit,
UNSUPPORTED_VERSION / UNKNOWN_KIND from the envelope, MALFORMED for the rest.
"""

from __future__ import annotations

import hashlib
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Annotated, Any, Generic, TypeVar, Union, get_args, get_origin

import msgspec

from peerd.errors import ErrorCode, ProtocolError

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder(order="sorted")
_PATH = re.compile(r" - at `\$(.*)`$")


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def canonical_pack(tree: Any) -> bytes:
    """Canonical msgpack of a tree of builtins or structs (map keys and struct fields sorted)."""
    try:
        return _ENCODER.encode(to_builtin(tree))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"not encodable as msgpack: {exc}", code=ErrorCode.MALFORMED) from None


@cache
def _fields(cls: type[msgspec.Struct]) -> tuple[tuple[str, str, bool, bool], ...]:
    """(attribute, wire name, omitted-when-None, holds builtins only) per field of a struct type."""
    return tuple(
        (f.name, f.encode_name, f.default is None, _plain(f.type)) for f in msgspec.structs.fields(cls)
    )


_SCALARS = (int, float, str, bool, bytes, type(None))
_SCALAR_SET = frozenset(_SCALARS)  # exact types: an IntEnum member is not an int here
_KEEP = (bytes, bytearray, memoryview)  # bin on the wire, not base64 text


def _plain(tp: Any) -> bool:
    """Whether a field type holds builtins only (scalars, and lists and maps of them): such a
    value needs no struct or enum conversion, so C code copies it (a shard's token lists are
    thousands of items, and a Python call per item cost a rollout peer a millisecond per push)."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _plain(get_args(tp)[0])
    # not tuple: msgspec.to_builtins keeps a tuple, to_builtin makes it a list
    if origin in (Union, types.UnionType, list, dict):
        return all(_plain(a) for a in get_args(tp)) and bool(get_args(tp))
    return tp in _SCALARS


def to_builtin(obj: Any) -> Any:
    """Structs as maps of their wire names (absent optionals left out, the tag written), enums as values."""
    if isinstance(obj, msgspec.Struct):
        out: dict[str, Any] = {}
        config = obj.__struct_config__
        if config.tag_field is not None:
            out[config.tag_field] = config.tag
        for attr, name, optional, plain in _fields(type(obj)):
            value = getattr(obj, attr)
            if value is None and optional:
                continue
            out[name] = msgspec.to_builtins(value, builtin_types=_KEEP) if plain else to_builtin(value)
        return out
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, list | tuple):
        if _SCALAR_SET.issuperset(map(type, obj)):  # a leaf list: no call per item
            return list(obj)
        return [to_builtin(x) for x in obj]
    if isinstance(obj, Mapping):
        return {k: to_builtin(v) for k, v in obj.items()}
    return obj


def _reject_ext(code: int, data: memoryview) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


_ANY_DECODER = msgspec.msgpack.Decoder(ext_hook=_reject_ext)


def _check_size(raw: Any, max_bytes: int, what: str) -> None:
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise ProtocolError(f"{what}: expected bytes, got {type(raw).__name__}")
    if len(raw) > max_bytes:
        raise ProtocolError(
            f"{what}: {len(raw)} bytes exceeds the {max_bytes}-byte limit", code=ErrorCode.OVERSIZED
        )


def decode_map(raw: Any, *, max_bytes: int, what: str) -> dict[str, Any]:
    """Size-check and unpack one msgpack map with str keys (no ext types, no trailing bytes)."""
    _check_size(raw, max_bytes, what)
    try:
        obj = _ANY_DECODER.decode(raw)
    except Exception as exc:  # DecodeError, or the ValueError of _reject_ext
        raise ProtocolError(f"{what}: not valid msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: top level must be a map, got {type(obj).__name__}")
    if not all(isinstance(k, str) for k in obj):
        raise ProtocolError(f"{what}: map keys must be strings")
    return obj


def check_envelope(
    m: Mapping[str, Any], *, what: str, version: int, kind: str | None, version_field: str = "v"
) -> None:
    """The version and kind every peerd message carries: UNSUPPORTED_VERSION / UNKNOWN_KIND before any field."""
    got = m.get(version_field)
    if isinstance(got, bool) or not isinstance(got, int):
        raise ProtocolError(f"{what}: missing or non-integer version {version_field!r}")
    if got != version:
        raise ProtocolError(
            f"{what}: unsupported version {got} (this peer speaks {version})",
            code=ErrorCode.UNSUPPORTED_VERSION,
        )
    if kind is None:
        return
    got_kind = m.get("kind")
    if not isinstance(got_kind, str):
        raise ProtocolError(f"{what}: missing or non-string 'kind'")
    if got_kind != kind:
        raise ProtocolError(f"{what}: unexpected kind {got_kind[:32]!r}", code=ErrorCode.UNKNOWN_KIND)


def protocol_error(exc: msgspec.ValidationError, what: str) -> ProtocolError:
    """A msgspec validation error as a ProtocolError naming the dotted field."""
    text = str(exc)
    match = _PATH.search(text)
    path = (match.group(1).lstrip(".") if match else "") or "top level"
    detail = text[: match.start()] if match else text
    # too many items is OVERSIZED (the spec's limits on counts); a too-long string is just MALFORMED
    code = (
        ErrorCode.OVERSIZED
        if re.match(r"Expected `(array|object)` of length <=", detail)
        else ErrorCode.MALFORMED
    )
    return ProtocolError(f"{what}: {path}: {detail[:1].lower()}{detail[1:]}", code=code)


def decode_value(raw: Any, cls: Any, *, max_bytes: int, what: str) -> Any:
    """Size-check and decode msgpack straight into ``cls`` (for a value that is not a map, e.g. an array)."""
    _check_size(raw, max_bytes, what)
    try:
        return msgspec.msgpack.decode(raw, type=cls, ext_hook=_reject_ext)
    except msgspec.ValidationError as exc:
        raise protocol_error(exc, what) from None
    except Exception as exc:  # DecodeError, or the ValueError of _reject_ext
        raise ProtocolError(f"{what}: not valid msgpack: {exc}") from None


def convert(m: Any, cls: type[T], *, what: str) -> T:
    """Validate an unpacked map against a schema: types, bounds and the schema's own checks."""
    try:
        return msgspec.convert(m, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise protocol_error(exc, what) from None


@cache
def _nil_plan(cls: type) -> dict[str, tuple[bool, type | None, bool]]:
    """Per wire name of struct ``cls``: (has a default, the struct type inside it, is it a list of them)."""
    plan = {}
    for f in msgspec.structs.fields(cls):
        has_default = f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT
        plan[f.encode_name] = (has_default, *_inner_struct(f.type))
    return plan


def _inner_struct(tp: Any) -> tuple[type | None, bool]:
    """The struct type a field holds (itself, optionally, or as the items of a list/tuple), if any."""
    if get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, types.UnionType):
        inner = [_inner_struct(a) for a in get_args(tp) if a is not type(None)]
        return inner[0] if len(inner) == 1 else (None, False)
    if get_origin(tp) in (list, tuple) and get_args(tp):
        item, _ = _inner_struct(get_args(tp)[0])
        return item, item is not None
    return (tp, False) if isinstance(tp, type) and issubclass(tp, msgspec.Struct) else (None, False)


def without_nil_optionals(m: Any, cls: type) -> Any:
    """``m`` without the ``nil`` values of fields of ``cls`` that have a default (protocols/README.md:
    nil in an optional field reads as absent), at every level of nested structs. A nil in a required
    field stays (a typed error names it); free-form maps (a job's spec) are left as they are."""
    if not isinstance(m, dict) or not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
        return m
    plan = _nil_plan(cls)
    out = {}
    for key, value in m.items():
        has_default, inner, many = plan.get(key, (False, None, False))
        if value is None and has_default:
            continue
        if inner is not None:
            value = (
                [without_nil_optionals(v, inner) for v in value]
                if many and isinstance(value, list)
                else (value if many else without_nil_optionals(value, inner))
            )
        out[key] = value
    return out


@dataclass(frozen=True)
class Schema(Generic[T]):
    """One message type on the wire: its struct, size limit and envelope."""

    cls: type[T]
    what: str
    """How errors name the message ("peer record", "consensus vote", ...)."""
    max_bytes: int
    version: int = 1
    kind: str | None = None
    """The ``kind`` the envelope must carry (None: the struct's tag, if any, checks it)."""
    version_field: str = "v"
    rules: Callable[[T], None] | None = None
    """Checks across fields (raise ``ProtocolError``), run after the schema on decode and encode."""
    omit_when_empty: frozenset[str] = frozenset()
    """Top-level wire names left out when their value is empty ("", [], {}): optional fields whose
    spec says absent rather than empty, where the default is not None."""

    def check(self, m: Mapping[str, Any]) -> T:
        """Envelope, schema, then rules, of an already unpacked map (a frame header)."""
        check_envelope(
            m, what=self.what, version=self.version, kind=self.kind, version_field=self.version_field
        )
        return self._checked(m)

    def _checked(self, m: Any) -> T:
        obj = convert(without_nil_optionals(m, self.cls), self.cls, what=self.what)
        if self.rules is not None:
            self.rules(obj)
        return obj

    def decode(self, raw: Any) -> T:
        return self.check(decode_map(raw, max_bytes=self.max_bytes, what=self.what))

    def encode(self, obj: T) -> bytes:
        """Canonical bytes of ``obj``, after the checks a receiver runs (a bug must not reach the wire).

        Going through the schema also makes every float field a float64 on the wire, even where
        the value was built from an int.
        """
        tree = to_builtin(self._checked(to_builtin(obj)))
        raw = canonical_pack({k: v for k, v in tree.items() if k not in self.omit_when_empty or v})
        _check_size(raw, self.max_bytes, self.what)
        return raw
