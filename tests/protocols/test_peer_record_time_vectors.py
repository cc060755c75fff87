"""The peer record's freshness check against the ``time`` vectors in protocols/vectors/peer_record/.

Kept apart from the codec's byte-exact vectors (test_peer_record_vectors.py), which use
only ``encode_peer_record`` and ``decode_peer_record``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peerd.errors import ErrorCode, ProtocolError
from peerd.swarm.records import check_record_time, decode_peer_record

VECTORS = Path(__file__).resolve().parents[2] / "protocols" / "vectors" / "peer_record"
ALL = {p.stem: json.loads(p.read_text()) for p in sorted(VECTORS.glob("*.json"))}
CASES = {name: case for name, case in ALL.items() if case["type"] == "time"}


def test_there_are_time_vectors():
    assert len(CASES) >= 5


@pytest.mark.parametrize("name", sorted(CASES))
def test_time_vector_gives_its_verdict(name: str):
    case = CASES[name]
    rec = decode_peer_record(bytes.fromhex(case["msgpack_hex"]))
    if case["error"] is None:
        check_record_time(rec, case["now"], expiration_time=case["expiration_time"])
    else:
        with pytest.raises(ProtocolError) as info:
            check_record_time(rec, case["now"], expiration_time=case["expiration_time"])
        assert info.value.code == ErrorCode[case["error"]]
