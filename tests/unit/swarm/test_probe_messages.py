"""The probe protocol's two bodies with numbers in them (protocols/probes.md), as wire schemas."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.errors import ErrorCode, ProtocolError
from peerd.swarm.framing import encode_header, parse_header
from peerd.swarm.links import DOWN_REQUEST, UP_RESULT, _DownRequest, _Timed
from peerd.wire import convert, to_builtin

SCHEMAS = {UP_RESULT: _Timed, DOWN_REQUEST: _DownRequest}


def frame(kind: str, body: object) -> bytes:
    return encode_header({"kind": kind, **to_builtin(body)})


def read(raw: bytes) -> object:
    """As the probe handlers read a body: an unknown kind is UNKNOWN_KIND (a flipped byte can make one)."""
    header = parse_header(raw)
    schema = SCHEMAS.get(header["kind"])
    if schema is None:
        raise ProtocolError(f"unknown probe message {header['kind']!r}", code=ErrorCode.UNKNOWN_KIND)
    return convert(header, schema, what=header["kind"])


timed = st.builds(
    _Timed,
    total_bytes=st.integers(0, 1 << 50),
    timed_bytes=st.integers(0, 1 << 50),
    duration_s=st.floats(0, 1e6),
)
asks = st.builds(
    _DownRequest,
    nbytes=st.integers(1, 1 << 40),
    seconds=st.floats(0, 3600),
    frame_bytes=st.integers(1, 1 << 30),
)
bodies = st.tuples(st.just(UP_RESULT), timed) | st.tuples(st.just(DOWN_REQUEST), asks)


@settings(max_examples=200, deadline=None)
@given(bodies)
def test_round_trip_is_the_identity(kind_body):
    kind, body = kind_body
    raw = frame(kind, body)
    assert read(raw) == body
    assert frame(kind, read(raw)) == raw


@settings(max_examples=300, deadline=None)
@given(bodies, st.data())
def test_truncation_or_byte_flips_only_ever_give_protocol_errors(kind_body, data):
    raw = bytearray(frame(*kind_body))
    for _ in range(data.draw(st.integers(0, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(raw)))
    with contextlib.suppress(ProtocolError):
        read(bytes(raw[:cut]))  # a flip may also leave a valid header: anything but a crash


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"bytes": 0, "seconds": 1.0, "frame_bytes": 1024}, "bytes"),  # asks for nothing
        ({"bytes": 1 << 41, "seconds": 1.0, "frame_bytes": 1024}, "bytes"),
        ({"bytes": 1024, "seconds": None, "frame_bytes": 1024}, "seconds"),
        ({"bytes": 1024, "seconds": 1.0, "frame_bytes": True}, "frame_bytes"),
        ({"bytes": 1024, "seconds": 1.0}, "frame_bytes"),
    ],
)
def test_a_bad_download_request_names_its_field(body: dict, field: str):
    with pytest.raises(ProtocolError) as info:
        convert({"kind": DOWN_REQUEST, **body}, _DownRequest, what=DOWN_REQUEST)
    assert info.value.code == ErrorCode.MALFORMED and field in str(info.value)
