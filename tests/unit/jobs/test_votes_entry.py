"""The votes entry (a voter's encoded votes under ``votes_key``): round trip and corruption."""

from __future__ import annotations

import contextlib

from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.errors import ProtocolError
from peerd.jobs.catalog import decode_votes, encode_votes

entries = st.lists(st.binary(max_size=300), min_size=1, max_size=2)


@settings(max_examples=200, deadline=None)
@given(entries)
def test_round_trip_is_the_identity(votes):
    raw = encode_votes(votes)
    assert decode_votes(raw) == votes
    assert encode_votes(decode_votes(raw)) == raw


@settings(max_examples=300, deadline=None)
@given(entries, st.data())
def test_truncation_or_byte_flips_only_ever_give_protocol_errors(votes, data):
    raw = bytearray(encode_votes(votes))
    for _ in range(data.draw(st.integers(0, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    with contextlib.suppress(ProtocolError):
        decode_votes(bytes(raw[: data.draw(st.integers(0, len(raw)))]))
