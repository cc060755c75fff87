"""Pipeline frame headers, by property: valid headers round-trip exactly; damaged header bytes are ProtocolErrors.

Bytes go through ``peerd.swarm.framing`` (``encode_header`` / ``parse_header``), as on a stream.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerd.errors import ErrorCode, ProtocolError
from peerd.pipeline.frames import (
    DATA_KINDS,
    DTYPES,
    MAX_NDIM,
    Abort,
    Ack,
    Nack,
    Part,
    TensorMessage,
    control_header,
    parse_control,
    parse_part,
    part_header,
)
from peerd.swarm.framing import encode_header, parse_header

counts = st.integers(0, 2**64 - 1)
names = st.text(min_size=1, max_size=24)
codes = st.sampled_from(list(ErrorCode))
texts = st.text(max_size=64)


@st.composite
def parts(draw: st.DrawFn) -> Part:
    nbytes = draw(counts)
    msg = TensorMessage(
        draw(st.sampled_from(DATA_KINDS)),
        draw(names),
        draw(counts),
        draw(st.integers(0, 2**16 - 1)),
        draw(st.integers(0, 2**16 - 1)),
        tuple(draw(st.lists(counts, max_size=24, unique=True))),
        draw(names),
        tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=MAX_NDIM))),
        draw(st.sampled_from(sorted(DTYPES))),
        draw(counts),
        nbytes,
    )
    count = draw(st.integers(1, 2**16))
    return Part(msg, draw(st.integers(0, count - 1)), count, draw(st.integers(0, nbytes)))


controls = st.one_of(
    st.builds(Ack, counts),
    st.builds(Nack, st.integers(-1, 2**63), codes, texts),
    st.builds(Abort, counts, codes, texts),
)


def _header(value: Part | Ack | Nack | Abort) -> dict[str, Any]:
    if isinstance(value, Part):
        return part_header(value.message, value.index, value.count, value.offset)
    return control_header(value)


def _parse(header: dict[str, Any]) -> Part | Ack | Nack | Abort:
    return parse_part(header) if header["kind"] in DATA_KINDS else parse_control(header)


SCHEMAS = {"data": parts(), "control": controls}
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("schema", SCHEMAS)
@PROPERTY
@given(data=st.data())
def test_encode_decode_is_the_identity_and_bytes_are_stable(schema: str, data: st.DataObject) -> None:
    value = data.draw(SCHEMAS[schema])
    raw = encode_header(_header(value))
    back = _parse(parse_header(raw))
    assert back == value
    assert encode_header(_header(back)) == raw


@pytest.mark.parametrize("schema", SCHEMAS)
@PROPERTY
@given(data=st.data())
def test_every_truncation_is_a_protocol_error(schema: str, data: st.DataObject) -> None:
    raw = encode_header(_header(data.draw(SCHEMAS[schema])))
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(ProtocolError):
        _parse(parse_header(raw[:cut]))


@pytest.mark.parametrize("schema", SCHEMAS)
@PROPERTY
@given(data=st.data())
def test_a_flipped_byte_is_a_protocol_error_or_another_valid_header(schema: str, data: st.DataObject) -> None:
    raw = bytearray(encode_header(_header(data.draw(SCHEMAS[schema]))))
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    try:
        value = _parse(parse_header(bytes(raw)))
    except ProtocolError:
        return
    # a flip inside a value or an ignored key can leave a valid header: it then reads back as itself
    assert _parse(parse_header(encode_header(_header(value)))) == value
