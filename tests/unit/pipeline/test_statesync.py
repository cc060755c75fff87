"""The pure parts of state transfer: blobs, messages, the chunk plan and the resumable, hash-checked assembly.

tests/integration/test_statesync.py runs the server and client over real p2pd daemons.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from peerd.errors import ConfigError, ErrorCode, ProtocolError
from peerd.pipeline.statesync import (
    KIND_DATA,
    KIND_INFO,
    REPLY_KINDS,
    REQUEST_KINDS,
    Assembly,
    ChunkRequest,
    Describe,
    Info,
    StateSyncConfig,
    chunk_plan,
    header,
    pack_state,
    parse,
    state_protocol,
    unpack_state,
)

BLOB = bytes(range(256)) * 40  # 10240 bytes
SHA = hashlib.sha256(BLOB).digest()


def info(size: int = len(BLOB), sha: bytes = SHA) -> Info:
    return Info(stage=2, step=7, size=size, sha256=sha, chunk=4096)


def test_pack_and_unpack_round_trip_tensors_and_plain_values():
    state = {"module": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 7, "data": {"position": [1, 2]}}
    back = unpack_state(pack_state(state))
    assert back["step"] == 7 and back["data"] == {"position": [1, 2]}
    torch.testing.assert_close(back["module"]["w"], state["module"]["w"], rtol=0, atol=0)


@pytest.mark.parametrize("raw", [b"", b"not a zip file at all", pack_state({"x": 1})[:-40]])
def test_unpack_rejects_garbage_as_malformed(raw: bytes):
    with pytest.raises(ProtocolError) as err:
        unpack_state(raw)
    assert err.value.code == ErrorCode.MALFORMED


def test_unpack_rejects_a_blob_that_is_not_a_dict():
    with pytest.raises(ProtocolError, match="holds a list"):
        unpack_state(pack_state([1, 2]))  # type: ignore[arg-type]


def test_unpack_refuses_code_execution():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    import io
    import pickle

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf, pickle_module=pickle)
    with pytest.raises(ProtocolError):
        unpack_state(buf.getvalue())


def test_messages_round_trip_through_their_headers():
    for msg, kinds in (
        (Describe(stage=2, step=7), REQUEST_KINDS),
        (ChunkRequest(stage=2, step=7, offset=4096, length=4096), REQUEST_KINDS),
        (info(), REPLY_KINDS),
    ):
        assert parse(header(msg), kinds) == msg


@pytest.mark.parametrize(
    "change, code",
    [
        ({"v": 2}, ErrorCode.UNSUPPORTED_VERSION),
        ({"kind": "state.push"}, ErrorCode.UNKNOWN_KIND),
        ({"kind": KIND_DATA}, ErrorCode.UNKNOWN_KIND),  # a reply kind, not the one asked for
        ({"sha256": SHA[:31]}, ErrorCode.MALFORMED),
        ({"size": -1}, ErrorCode.MALFORMED),
        ({"chunk": 0}, ErrorCode.MALFORMED),
        ({"step": True}, ErrorCode.MALFORMED),
        ({"stage": "2"}, ErrorCode.MALFORMED),
    ],
)
def test_bad_info_headers_get_their_codes(change: dict, code: ErrorCode):
    with pytest.raises(ProtocolError) as err:
        parse(header(info()) | change, (KIND_INFO,))
    assert err.value.code == code


def test_unknown_fields_are_ignored():
    assert parse(header(info()) | {"note": "later versions may add this"}, REPLY_KINDS) == info()


def test_chunk_plan_covers_the_rest_in_bounded_pieces():
    assert list(chunk_plan(10, 0, 4)) == [(0, 4), (4, 4), (8, 2)]
    assert list(chunk_plan(10, 8, 4)) == [(8, 2)]
    assert list(chunk_plan(10, 10, 4)) == []
    assert list(chunk_plan(0, 0, 4)) == []


def test_assembly_verifies_the_hash():
    a = Assembly(max_bytes=1 << 20)
    assert a.adopt("A", info()) == 0
    for offset, length in chunk_plan(len(BLOB), 0, 3000):
        a.add(offset, BLOB[offset : offset + length])
    assert a.complete and a.finish() == BLOB


def test_assembly_names_every_source_of_a_corrupt_blob():
    a = Assembly(max_bytes=1 << 20)
    a.adopt("A", info())
    a.add(0, BLOB[:5000])
    assert a.adopt("B", info()) == 5000  # same blob: resume
    a.add(5000, BLOB[5000:-1] + b"\x00")
    with pytest.raises(ProtocolError, match="state from A, B hashes to") as err:
        a.finish()
    assert err.value.code == ErrorCode.MALFORMED


def test_assembly_starts_over_for_another_blob():
    a = Assembly(max_bytes=1 << 20)
    a.adopt("A", info())
    a.add(0, BLOB[:5000])
    other = BLOB[::-1]
    assert a.adopt("B", info(sha=hashlib.sha256(other).digest())) == 0
    assert a.received == 0 and a.sources == ["B"]
    a.add(0, other)
    assert a.finish() == other


def test_assembly_refuses_a_state_above_the_cap_before_taking_anything():
    a = Assembly(max_bytes=1000)
    with pytest.raises(ProtocolError, match="10240-byte state, more than the 1000 B") as err:
        a.adopt("A", info())
    assert err.value.code == ErrorCode.OVERSIZED and a.size is None


def test_assembly_refuses_another_hash_than_expected():
    a = Assembly(max_bytes=1 << 20, expected_sha256=hashlib.sha256(b"other").digest())
    with pytest.raises(ProtocolError) as err:
        a.adopt("A", info())
    assert err.value.code == ErrorCode.STALE


def test_protocol_name_and_config_validation():
    assert state_protocol("ab" * 16) == f"peerd/{'ab' * 16}/state/1"
    with pytest.raises(ConfigError, match=r"statesync\.chunk_bytes"):
        StateSyncConfig(chunk_bytes=0)
    with pytest.raises(ConfigError, match=r"statesync\.deadline_s"):
        StateSyncConfig(deadline_s=0)
