"""The peer-record codec against the committed byte-exact vectors in protocols/vectors/peer_record/."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from peerd.errors import ErrorCode, ProtocolError
from peerd.swarm.records import (
    PeerRecord,
    check_record_time,
    decode_peer_record,
    encode_peer_record,
    peer_record_to_wire,
)

VECTORS = Path(__file__).resolve().parents[2] / "protocols" / "vectors" / "peer_record"
CASES = {p.stem: json.loads(p.read_text()) for p in sorted(VECTORS.glob("*.json"))}


def packed_canonically(wire: object) -> bytes:
    """The spec's canonical form, written independently of the codec: sorted keys, msgpack-python defaults."""

    def sort(obj: object) -> object:
        if isinstance(obj, dict):
            return {k: sort(obj[k]) for k in sorted(obj)}
        if isinstance(obj, list):
            return [sort(x) for x in obj]
        return obj

    return msgpack.packb(sort(wire), use_bin_type=True)


def of_type(kind: str) -> list[str]:
    return [name for name, case in CASES.items() if case["type"] == kind]


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
    rec = decode_peer_record(raw)
    assert isinstance(rec, PeerRecord)
    assert peer_record_to_wire(rec) == case["record"]
    assert encode_peer_record(rec) == raw
    assert packed_canonically(case["record"]) == raw


@pytest.mark.parametrize("name", of_type("decode"))
def test_tolerated_variation_decodes_to_its_canonical_form(name: str):
    case = CASES[name]
    rec = decode_peer_record(bytes.fromhex(case["msgpack_hex"]))
    assert peer_record_to_wire(rec) == case["record"]
    canonical = bytes.fromhex(case["canonical_hex"])
    assert encode_peer_record(rec) == canonical
    assert decode_peer_record(canonical) == rec


@pytest.mark.parametrize("name", of_type("reject"))
def test_reject_vector_fails_with_its_code(name: str):
    case = CASES[name]
    assert ErrorCode[case["error"]] == case["error_code"]  # names and numbers agree with peerd.errors
    with pytest.raises(ProtocolError) as info:
        decode_peer_record(bytes.fromhex(case["msgpack_hex"]))
    assert info.value.code == ErrorCode[case["error"]]


@pytest.mark.parametrize("name", of_type("time"))
def test_time_vector_gives_its_verdict(name: str):
    case = CASES[name]
    rec = decode_peer_record(bytes.fromhex(case["msgpack_hex"]))
    if case["error"] is None:
        check_record_time(rec, case["now"], expiration_time=case["expiration_time"])
    else:
        with pytest.raises(ProtocolError) as info:
            check_record_time(rec, case["now"], expiration_time=case["expiration_time"])
        assert info.value.code == ErrorCode[case["error"]]
