"""Consensus schemas, by property: generated valid messages round-trip exactly; damaged bytes are ProtocolErrors."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerd.errors import ProtocolError
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import (
    Candidate,
    CommitRecord,
    Message,
    RosterDevice,
    RosterEntry,
    RosterLink,
    Vote,
    decode,
    encode,
)

ids = st.text(min_size=1, max_size=12)
reals = st.floats(min_value=0.0, max_value=1e300, allow_nan=False, allow_infinity=False)
positive = st.floats(min_value=0.0, max_value=1e300, exclude_min=True, allow_nan=False, allow_infinity=False)
counts = st.integers(0, 2**64 - 1)
hashes = st.binary(min_size=32, max_size=32)
rounds = st.integers(0, 1)


@st.composite
def entries(draw: st.DrawFn) -> RosterEntry:
    device = RosterDevice(draw(reals), draw(counts), draw(st.text(max_size=8)))
    links = draw(
        st.lists(st.builds(RosterLink, ids, reals, positive), max_size=6, unique_by=lambda x: x.peer)
    )
    links.sort(key=lambda link: link.peer)
    return RosterEntry(draw(ids), draw(counts), draw(ids), draw(reals), device, tuple(links))


@st.composite
def candidates(draw: st.DrawFn) -> Candidate:
    peers = draw(st.lists(ids, min_size=1, max_size=10, unique=True))
    d_pp = draw(st.integers(1, len(peers)))
    d_dp = draw(st.integers(1, len(peers) // d_pp))
    used = d_pp * d_dp
    stages = [peers[i * d_dp : (i + 1) * d_dp] for i in range(d_pp)]
    spares = peers[used : used + draw(st.integers(0, len(peers) - used))]
    layers = draw(st.none() | st.lists(st.integers(1, 1000), min_size=d_pp, max_size=d_pp))
    allocation = Allocation.from_plain(stages, spares, layers)
    members = tuple(sorted(set(peers) | set(draw(st.lists(ids, max_size=3)))))
    return Candidate(
        draw(ids), draw(counts), draw(ids), draw(reals), allocation, draw(reals), members, draw(hashes)
    )


votes = st.builds(Vote, ids, counts, rounds, ids, reals, hashes, reals, hashes)


@st.composite
def commits(draw: st.DrawFn) -> CommitRecord:
    roster = draw(st.dictionaries(ids, hashes, max_size=6))
    ballot = draw(st.lists(votes, max_size=5, unique_by=lambda v: v.voter))
    ballot.sort(key=lambda v: v.voter)
    return CommitRecord(
        draw(ids),
        draw(counts),
        draw(rounds),
        draw(ids),
        draw(reals),
        draw(candidates()),
        tuple(sorted(roster.items())),
        tuple(ballot),
    )


SCHEMAS = {"roster": entries(), "candidate": candidates(), "vote": votes, "commit": commits()}
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("kind", SCHEMAS)
@PROPERTY
@given(data=st.data())
def test_encode_decode_is_the_identity_and_bytes_are_stable(kind: str, data: st.DataObject) -> None:
    msg: Message = data.draw(SCHEMAS[kind])
    raw = encode(msg)
    back = decode(raw, type(msg))
    assert back == msg and kind == back.KIND
    assert encode(back) == raw


@pytest.mark.parametrize("kind", SCHEMAS)
@PROPERTY
@given(data=st.data())
def test_every_truncation_is_a_protocol_error(kind: str, data: st.DataObject) -> None:
    raw = encode(data.draw(SCHEMAS[kind]))
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(ProtocolError):
        decode(raw[:cut])


@pytest.mark.parametrize("kind", SCHEMAS)
@PROPERTY
@given(data=st.data())
def test_a_flipped_byte_is_a_protocol_error_or_another_valid_message(kind: str, data: st.DataObject) -> None:
    raw = bytearray(encode(data.draw(SCHEMAS[kind])))
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    try:
        msg = decode(bytes(raw))
    except ProtocolError:
        return
    encode(msg)  # whatever a receiver accepts, it can also write (a flip inside a value, an ignored key)
