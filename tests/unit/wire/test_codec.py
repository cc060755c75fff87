"""peerd.wire: the canonical encoder and the bounded, strict decoder shared by every schema."""

from __future__ import annotations

import contextlib
from enum import StrEnum
from typing import Annotated

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import Meta

from peerd.errors import ErrorCode, ProtocolError
from peerd.wire import Schema, WireStruct, canonical_pack, decode_map, decode_value, to_builtin
from peerd.wire.codec import without_nil_optionals
from peerd.wire.types import Count, Hash32, PeerId, Real


class Colour(StrEnum):
    RED = "red"
    BLUE = "blue"


class Inner(WireStruct, kw_only=True):
    weight: Real
    note: str | None = None


class Sample(WireStruct, kw_only=True, tag_field="kind", tag="sample"):
    version: int = msgspec.field(default=1, name="v")
    count: Count
    colour: Colour
    digest: Hash32
    owner: PeerId
    items: Annotated[list[Inner], Meta(max_length=3)] = msgspec.field(default_factory=list)
    label: str | None = None


def _rules(s: Sample) -> None:
    if s.count < len(s.items):
        raise ProtocolError("sample: count: smaller than the number of items")


SAMPLE = Schema(Sample, "sample", 1024, kind="sample", rules=_rules)
OWNER = "QmNYG4mfj1dhLZBYBWEFyhYC2S2QDHZ8Ra5K7XKqtqBLAd"


def sample(**changes: object) -> Sample:
    base = Sample(count=2, colour=Colour.RED, digest=bytes(32), owner=OWNER, items=[Inner(weight=1)])
    return msgspec.structs.replace(base, **changes)


def independent_pack(tree: object) -> bytes:
    """The spec's canonical form written with msgpack-python: sorted keys, float64, bin for bytes."""

    def sort(obj: object) -> object:
        if isinstance(obj, dict):
            return {k: sort(obj[k]) for k in sorted(obj)}
        if isinstance(obj, list):
            return [sort(x) for x in obj]
        return obj

    return msgpack.packb(sort(tree), use_bin_type=True, use_single_float=False)


def test_encoding_is_canonical_and_floats_are_float64():
    raw = SAMPLE.encode(sample())
    tree = {
        "kind": "sample",
        "v": 1,
        "count": 2,
        "colour": "red",
        "digest": bytes(32),
        "owner": OWNER,
        "items": [{"weight": 1.0}],  # built from the int 1, written as float64; absent note omitted
    }
    assert raw == independent_pack(tree)
    assert SAMPLE.decode(raw) == sample(items=[Inner(weight=1.0)])


def test_canonical_pack_sorts_nested_keys_and_writes_tuples_as_arrays():
    assert canonical_pack({"b": (1, 2), "a": {"z": 1, "y": [Colour.BLUE]}}) == independent_pack(
        {"a": {"y": ["blue"], "z": 1}, "b": [1, 2]}
    )


def test_to_builtin_keeps_a_set_optional_and_drops_an_unset_one():
    assert to_builtin(Inner(weight=2.0, note="n")) == {"weight": 2.0, "note": "n"}
    assert to_builtin(Inner(weight=2.0)) == {"weight": 2.0}


class Plain(WireStruct, kw_only=True):
    tokens: list[list[int]]
    blobs: dict[str, bytes]
    pair: tuple[int, ...] = ()
    items: list[Inner] = msgspec.field(default_factory=list)


def test_builtin_fields_and_leaf_lists_convert_as_the_item_by_item_walk_does():
    msg = Plain(tokens=[[1, 2], [3]], blobs={"a": b"\x00\xff"}, pair=(4, 5), items=[Inner(weight=1.5)])
    tree = to_builtin(msg)
    assert tree == {
        "tokens": [[1, 2], [3]],
        "blobs": {"a": b"\x00\xff"},
        "pair": [4, 5],
        "items": [{"weight": 1.5}],
    }
    assert isinstance(tree["blobs"]["a"], bytes)  # bin on the wire, never base64 text
    assert tree["tokens"] is not msg.tokens  # a copy: the caller's lists stay its own
    # a leaf list of exact builtins is copied whole; an enum or a struct among the items is still converted
    assert to_builtin([1, "x", None, 2.5]) == [1, "x", None, 2.5]
    assert to_builtin([1, Colour.RED]) == [1, "red"]
    assert to_builtin([Inner(weight=1.0), None]) == [{"weight": 1.0}, None]


def reencoded(**fields: object) -> bytes:
    tree = to_builtin(sample())
    tree.update(fields)
    return independent_pack(tree)


@pytest.mark.parametrize(
    ("raw", "code", "names"),
    [
        (reencoded(v=2), ErrorCode.UNSUPPORTED_VERSION, "version 2"),
        (reencoded(kind="other"), ErrorCode.UNKNOWN_KIND, "'other'"),
        (reencoded(count=None), ErrorCode.MALFORMED, "count"),  # explicit nil where none is allowed
        (reencoded(count=True), ErrorCode.MALFORMED, "count"),
        (reencoded(count=-1), ErrorCode.MALFORMED, "count"),
        (reencoded(count="2"), ErrorCode.MALFORMED, "count"),
        (reencoded(colour="green"), ErrorCode.MALFORMED, "colour"),
        (reencoded(digest=bytes(31)), ErrorCode.MALFORMED, "digest"),
        (reencoded(owner="not base58!"), ErrorCode.MALFORMED, "owner"),
        (reencoded(items=[{"weight": float("nan")}]), ErrorCode.MALFORMED, "items[0].weight"),
        (reencoded(items=[{"weight": float("inf")}]), ErrorCode.MALFORMED, "items[0].weight"),
        (reencoded(items=[{"weight": 1.0}] * 4), ErrorCode.OVERSIZED, "items"),
        (reencoded(count=0), ErrorCode.MALFORMED, "count: smaller"),  # a cross-field rule
        (independent_pack([1, 2]), ErrorCode.MALFORMED, "top level must be a map"),
        (independent_pack({1: 2}), ErrorCode.MALFORMED, "keys must be strings"),
        (SAMPLE.encode(sample()) + b"\x00", ErrorCode.MALFORMED, "not valid msgpack"),
        (msgpack.packb({"x": msgpack.ExtType(5, b"x")}), ErrorCode.MALFORMED, "extension type 5"),
        (b"\xc1", ErrorCode.MALFORMED, "not valid msgpack"),
        (b"x" * 1025, ErrorCode.OVERSIZED, "1025 bytes"),
    ],
)
def test_bad_bytes_give_the_code_and_name_the_field(raw: bytes, code: ErrorCode, names: str):
    with pytest.raises(ProtocolError) as info:
        SAMPLE.decode(raw)
    assert info.value.code == code
    assert names in str(info.value)


def test_unknown_fields_are_ignored_within_a_version():
    assert SAMPLE.decode(reencoded(future={"x": [1]})) == SAMPLE.decode(SAMPLE.encode(sample()))


def test_encode_refuses_what_a_receiver_would_reject():
    with pytest.raises(ProtocolError, match="items"):
        SAMPLE.encode(sample(items=[Inner(weight=-1.0)]))
    with pytest.raises(ProtocolError) as info:
        SAMPLE.encode(sample(count=10**6, items=[Inner(weight=1.0, note="x" * 2000)]))
    assert info.value.code == ErrorCode.OVERSIZED


def test_an_array_announced_larger_than_the_bytes_fails_without_allocating_it():
    # array32 header announcing 2**32-1 elements, followed by nothing
    with pytest.raises(ProtocolError) as info:
        decode_map(b"\x81\xa1a\xdd\xff\xff\xff\xff", max_bytes=64, what="x")
    assert info.value.code == ErrorCode.MALFORMED


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(3, 2**64 - 1),
    colour=st.sampled_from(Colour),
    digest=st.binary(min_size=32, max_size=32),
    weights=st.lists(st.floats(0, 1e300), max_size=3),
    label=st.none() | st.text(max_size=20),
)
def test_round_trip_is_the_identity(count, colour, digest, weights, label):
    s = Sample(
        count=count,
        colour=colour,
        digest=digest,
        owner=OWNER,
        items=[Inner(weight=w) for w in weights],
        label=label,
    )
    raw = SAMPLE.encode(s)
    assert SAMPLE.decode(raw) == s
    assert SAMPLE.encode(SAMPLE.decode(raw)) == raw


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_truncation_or_byte_flips_only_ever_give_protocol_errors(data):
    raw = bytearray(SAMPLE.encode(sample(label="abc")))
    for _ in range(data.draw(st.integers(0, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    with contextlib.suppress(ProtocolError):
        SAMPLE.decode(bytes(raw[:cut]))


def test_decode_value_reads_a_bounded_non_map_value():
    pair = Annotated[list[bytes], Meta(min_length=1, max_length=2)]
    assert decode_value(canonical_pack([b"a", b"b"]), pair, max_bytes=64, what="pair") == [b"a", b"b"]
    for raw, code in [
        (canonical_pack([]), ErrorCode.MALFORMED),
        (canonical_pack([b"a"] * 3), ErrorCode.OVERSIZED),
        (canonical_pack(["a"]), ErrorCode.MALFORMED),
        (canonical_pack([b"a"])[:-1], ErrorCode.MALFORMED),
        (bytes(65), ErrorCode.OVERSIZED),
    ]:
        with pytest.raises(ProtocolError) as info:
            decode_value(raw, pair, max_bytes=64, what="pair")
        assert info.value.code == code and str(info.value).startswith("pair: ")


def test_nil_in_a_field_with_a_default_reads_as_absent_at_every_level():
    tree = to_builtin(sample(items=[Inner(weight=1.0)]))
    tree.update(items=[{"weight": 1.0, "note": None}], label=None)
    assert SAMPLE.decode(independent_pack(tree)) == sample(items=[Inner(weight=1.0)])
    tree.update(items=None)  # a defaulted list given nil: its default, here an empty list
    with pytest.raises(ProtocolError, match="count: smaller"):  # ...which the rule then judges
        SAMPLE.decode(independent_pack({**tree, "count": 0, "items": [{"weight": 1.0}]}))
    assert SAMPLE.decode(independent_pack(tree)).items == []


def test_without_nil_optionals_leaves_free_form_maps_and_required_fields_alone():
    class Holder(WireStruct, kw_only=True):
        spec: dict[str, object]
        count: Count

    tree = {"spec": {"seq_len": None}, "count": None}
    assert without_nil_optionals(tree, Holder) == tree
