"""The peer-record codec against the committed byte-exact vectors in protocols/vectors/peer_record/.

The expected bytes come from the vector's JSON through an independent canonical writer
(canonical_msgpack.py: no peerd, no msgpack library), so a bug in peerd's encoder cannot
also be in what it is compared with. Only ``encode_peer_record`` and ``decode_peer_record``
are used from peerd; the freshness verdicts (``time`` vectors) are checked in
test_peer_record_time_vectors.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from peerd.errors import ErrorCode, ProtocolError
from peerd.swarm.records import decode_peer_record, encode_peer_record

_spec = importlib.util.spec_from_file_location(
    "canonical_msgpack", Path(__file__).with_name("canonical_msgpack.py")
)
canonical_msgpack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(canonical_msgpack)  # type: ignore[union-attr]
canonical = canonical_msgpack.canonical

VECTORS = Path(__file__).resolve().parents[2] / "protocols" / "vectors" / "peer_record"
CASES = {p.stem: json.loads(p.read_text()) for p in sorted(VECTORS.glob("*.json"))}
HEADER = {"v", "kind"}  # the record's version and kind: checked through the bytes, not as attributes


def of_type(kind: str) -> list[str]:
    return [name for name, case in CASES.items() if case["type"] == kind]


def assert_decoded_as(value: Any, wire: Any, path: str = "record") -> None:
    """``value`` (what peerd decoded) carries ``wire`` (the vector's JSON): field by field, by wire name."""
    if isinstance(wire, dict):
        for key, expected in wire.items():
            if path == "record" and key in HEADER:
                continue
            got = value[key] if isinstance(value, dict) else getattr(value, key)
            assert_decoded_as(got, expected, f"{path}.{key}")
    elif isinstance(wire, list):
        assert len(value) == len(wire), path
        for i, (got, expected) in enumerate(zip(value, wire, strict=True)):
            assert_decoded_as(got, expected, f"{path}[{i}]")
    elif isinstance(wire, bool):
        assert value is wire, f"{path}: {value!r} is not {wire!r}"
    else:  # an enum member equals its wire string; an int read where a float is expected equals it
        assert value == wire, f"{path}: {value!r} != {wire!r}"


def test_vector_set_covers_the_spec():
    assert len(of_type("encode")) >= 5 and len(of_type("decode")) >= 3 and len(of_type("time")) >= 5
    reject_codes = {CASES[name]["error"] for name in of_type("reject")}
    assert {"MALFORMED", "OVERSIZED", "UNSUPPORTED_VERSION", "UNKNOWN_KIND"} <= reject_codes
    time_codes = {CASES[name]["error"] for name in of_type("time")}
    assert {None, "FROM_FUTURE", "STALE"} <= time_codes
    assert set(CASES) == set(of_type("encode") + of_type("decode") + of_type("reject") + of_type("time"))


@pytest.mark.parametrize("name", of_type("encode"))
def test_encode_vector_is_byte_exact(name: str):
    case = CASES[name]
    raw = bytes.fromhex(case["msgpack_hex"])
    assert canonical(case["record"]) == raw  # the committed bytes are the spec's canonical form
    rec = decode_peer_record(raw)
    assert_decoded_as(rec, case["record"])
    assert encode_peer_record(rec) == raw


@pytest.mark.parametrize("name", of_type("decode"))
def test_tolerated_variation_decodes_to_its_canonical_form(name: str):
    case = CASES[name]
    canonical_bytes = bytes.fromhex(case["canonical_hex"])
    assert canonical(case["record"]) == canonical_bytes
    rec = decode_peer_record(bytes.fromhex(case["msgpack_hex"]))
    assert_decoded_as(rec, case["record"])
    assert encode_peer_record(rec) == canonical_bytes
    assert encode_peer_record(decode_peer_record(canonical_bytes)) == canonical_bytes


@pytest.mark.parametrize("name", of_type("reject"))
def test_reject_vector_fails_with_its_code(name: str):
    case = CASES[name]
    assert ErrorCode[case["error"]] == case["error_code"]  # names and numbers agree with peerd.errors
    with pytest.raises(ProtocolError) as info:
        decode_peer_record(bytes.fromhex(case["msgpack_hex"]))
    assert info.value.code == ErrorCode[case["error"]]
