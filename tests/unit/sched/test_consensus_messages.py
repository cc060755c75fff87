"""Consensus message codec: round trips, canonical bytes, tolerant decoding, typed errors."""

from __future__ import annotations

import math

import msgpack
import pytest

from peerd.errors import ErrorCode, ProtocolError
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import (
    Candidate,
    CommitRecord,
    Roster,
    RosterDevice,
    RosterEntry,
    RosterLink,
    Vote,
    decode,
    encode,
)

PEERS = ("QmA", "QmB", "QmC", "QmD")


def entry(peer: str = "QmA", **kw) -> RosterEntry:
    links = tuple(RosterLink(q, 0.01, 1e9) for q in PEERS if q != peer)
    fields = {
        "job": "j",
        "epoch": 2,
        "peer": peer,
        "issued_at": 5.5,
        "profile": RosterDevice(10.0, 1 << 34, "eu"),
        "links": links,
    }
    return RosterEntry(**{**fields, **kw})


ROSTER = Roster.of(2, [entry(p) for p in PEERS])
ALLOC = Allocation.from_plain([["QmB", "QmA"], ["QmD", "QmC"]], layers=[3, 5])


def candidate(**kw) -> Candidate:
    fields = {
        "job": "j",
        "epoch": 2,
        "author": "QmA",
        "issued_at": 7.0,
        "allocation": ALLOC,
        "cost": 1.5,
        "members": ROSTER.peers,
        "roster_digest": ROSTER.digest,
    }
    return Candidate(**{**fields, **kw})


def vote(voter: str = "QmA", **kw) -> Vote:
    fields = {
        "job": "j",
        "epoch": 2,
        "round": 0,
        "voter": voter,
        "issued_at": 9.0,
        "candidate": candidate().id,
        "cost": 1.5,
        "roster_digest": ROSTER.digest,
    }
    return Vote(**{**fields, **kw})


def record() -> CommitRecord:
    return CommitRecord("j", 2, 0, "QmB", 10.0, candidate(), ROSTER.refs, tuple(vote(p) for p in PEERS[:3]))


@pytest.mark.parametrize("msg", [entry(), candidate(), vote(), record()], ids=lambda m: m.KIND)
def test_round_trip(msg) -> None:
    data = encode(msg)
    back = decode(data)
    assert encode(back) == data
    assert decode(data, type(msg)).KIND == msg.KIND


def test_canonical_bytes_do_not_depend_on_input_order() -> None:
    shuffled = entry(links=tuple(reversed(entry().links)))
    assert encode(shuffled) == encode(entry()) and shuffled.hash == entry().hash
    swapped = Allocation.from_plain([["QmA", "QmB"], ["QmC", "QmD"]], layers=[3, 5])  # replicas swapped
    assert encode(candidate(allocation=swapped)) == encode(candidate())
    assert candidate(allocation=swapped).id == candidate().id
    assert Roster.of(2, list(reversed(ROSTER.entries))).digest == ROSTER.digest


def test_hashes_depend_on_content() -> None:
    assert entry(issued_at=5.75).hash != entry().hash
    other = Roster.of(2, [entry(p) for p in PEERS[:3]])
    assert candidate(roster_digest=other.digest).id != candidate().id  # same allocation, other roster
    assert candidate(cost=9.0).id == candidate().id  # the claim is not part of the identity


def test_integral_numbers_decode_into_float_fields_and_re_encode_as_float64() -> None:
    raw = msgpack.unpackb(encode(vote()), raw=False)
    raw["cost"] = 3  # another implementation may write an int
    v = decode(msgpack.packb(raw, use_bin_type=True))
    assert v.cost == 3.0 and isinstance(v.cost, float)
    assert b"\xa4cost\xcb" in encode(v)


def test_unknown_keys_are_ignored_at_every_level() -> None:
    raw = msgpack.unpackb(encode(record()), raw=False)
    raw["extra"] = {"a": 1}
    raw["candidate"]["allocation"]["hint"] = "x"
    raw["votes"][0]["note"] = "y"
    assert decode(msgpack.packb(raw, use_bin_type=True)) == record()


@pytest.mark.parametrize(
    ("mutate", "code", "field"),
    [
        (lambda m: m.update(cost=math.nan), ErrorCode.MALFORMED, "cost"),
        (lambda m: m.update(cost=math.inf), ErrorCode.MALFORMED, "cost"),
        (lambda m: m.update(epoch=True), ErrorCode.MALFORMED, "epoch"),
        (lambda m: m.update(job=""), ErrorCode.MALFORMED, "job"),
        (lambda m: m.update(members="QmA"), ErrorCode.MALFORMED, "members"),
        (
            lambda m: m["allocation"].update(stages=[["QmA", "QmB"], ["QmC"]]),
            ErrorCode.MALFORMED,
            "allocation.stages[1]",
        ),
        (lambda m: m["allocation"].update(layers=[3]), ErrorCode.MALFORMED, "allocation.layers"),
        (lambda m: m["allocation"].update(layers=[3.0, 5.0]), ErrorCode.MALFORMED, "allocation.layers"),
        (lambda m: m["allocation"].update(spares="QmZ"), ErrorCode.MALFORMED, "allocation.spares"),
        (lambda m: m.update(version="1"), ErrorCode.MALFORMED, "version"),
        (lambda m: m.update(version=0), ErrorCode.UNSUPPORTED_VERSION, None),
        (lambda m: m.pop("kind"), ErrorCode.UNKNOWN_KIND, None),
    ],
)
def test_malformed_candidates_name_the_field(mutate, code: ErrorCode, field: str | None) -> None:
    raw = msgpack.unpackb(encode(candidate()), raw=False)
    mutate(raw)
    with pytest.raises(ProtocolError) as err:
        decode(msgpack.packb(raw, use_bin_type=True))
    assert err.value.code == code
    if field:
        assert field in str(err.value)


def test_malformed_entries_and_records() -> None:
    raw = msgpack.unpackb(encode(entry()), raw=False)
    raw["links"][0]["bandwidth_bps"] = 0.0
    with pytest.raises(ProtocolError, match="bandwidth_bps"):
        decode(msgpack.packb(raw, use_bin_type=True))
    raw = msgpack.unpackb(encode(record()), raw=False)
    raw["roster"][0] = ["QmA", b"short"]
    with pytest.raises(ProtocolError, match="roster"):
        decode(msgpack.packb(raw, use_bin_type=True))
    raw = msgpack.unpackb(encode(record()), raw=False)
    raw["candidate"]["allocation"]["stages"][1] = ["QmB", "QmC"]  # QmB twice, checked inside the commit too
    with pytest.raises(
        ProtocolError, match=r"candidate\.allocation\.stages\[1\]\[0\]: device 'QmB' appears twice"
    ):
        decode(msgpack.packb(raw, use_bin_type=True))
    raw = msgpack.unpackb(encode(record()), raw=False)
    raw["votes"][0]["version"] = 2
    with pytest.raises(ProtocolError, match="votes"):
        decode(msgpack.packb(raw, use_bin_type=True))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x92\x01",
        msgpack.packb({1: 2}),
        msgpack.packb({"version": 1, "kind": "vote", "x": msgpack.ExtType(3, b"")}),
    ],
)
def test_garbage_is_malformed_never_a_crash(data: bytes) -> None:
    with pytest.raises(ProtocolError) as err:
        decode(data)
    assert err.value.code in (ErrorCode.MALFORMED, ErrorCode.UNKNOWN_KIND)


def test_expected_kind_and_input_type_are_enforced() -> None:
    with pytest.raises(ProtocolError, match="expected kind 'vote'"):
        decode(encode(candidate()), Vote)
    with pytest.raises(ProtocolError):
        decode("not bytes")  # type: ignore[arg-type]


def test_size_limits() -> None:
    with pytest.raises(ProtocolError) as err:
        encode(vote(voter="Qm" + "x" * 5000))
    assert err.value.code == ErrorCode.OVERSIZED
    with pytest.raises(ProtocolError) as err:
        decode(b"\x00" * (3 << 20))
    assert err.value.code == ErrorCode.OVERSIZED


def test_roster_subset() -> None:
    sub = ROSTER.subset(["QmA", "QmC"])
    assert sub is not None and sub.peers == ("QmA", "QmC")
    assert ROSTER.subset(["QmA", "QmZ"]) is None
    assert ROSTER.entry("QmB") == entry("QmB") and ROSTER.entry("QmZ") is None


def test_roster_entry_held_state_round_trips_and_is_absent_when_empty() -> None:
    from peerd.sched.consensus.messages import HeldState, RosterDevice, RosterEntry, decode, encode

    base = RosterEntry("job", 1, "p", 2.0, RosterDevice(1.0, 2), ())
    assert b"held" not in encode(base)
    held = (HeldState(1, (2, 4), (7,)), HeldState(0, (0, 2), (6, 7)))
    entry = decode(encode(RosterEntry("job", 1, "p", 2.0, RosterDevice(1.0, 2), (), held)))
    assert [h.stage for h in entry.held] == [0, 1]  # encode sorts them
    assert entry.hash != base.hash


def test_a_roster_device_carries_its_machine_only_when_it_has_one() -> None:
    from peerd.errors import ProtocolError
    from peerd.sched.consensus.messages import RosterDevice, RosterEntry, decode, encode

    apart = RosterEntry("job", 1, "p", 2.0, RosterDevice(1.0, 2), ())
    assert b"host" not in encode(apart) and b"threads" not in encode(apart)
    shared = RosterEntry(
        "job", 1, "p", 2.0, RosterDevice(1.0, 2, "", 1e9, None, "0123456789abcdef", 2, 1), ()
    )
    assert decode(encode(shared)).profile == shared.profile and shared.hash != apart.hash
    with pytest.raises(ProtocolError, match="host"):
        encode(RosterEntry("job", 1, "p", 2.0, RosterDevice(1.0, 2, "", None, None, "not-hex", 2, 1), ()))


@pytest.mark.parametrize(
    ("held", "why"),
    [
        ([{"stage": 0, "layers": [2, 2], "steps": [1]}], "held[0].layers"),
        ([{"stage": 0, "layers": [0, 2], "steps": [3, 1]}], "held[0].steps"),
        ([{"stage": 0, "layers": [0, 2], "steps": [1]}] * 2, "held: must be sorted"),
    ],
)
def test_roster_entry_held_state_is_checked(held: list, why: str) -> None:
    from peerd.errors import ProtocolError
    from peerd.sched.consensus.messages import decode
    from peerd.wire import canonical_pack

    m = {
        "version": 1,
        "kind": "roster",
        "job": "job",
        "epoch": 1,
        "peer": "p",
        "issued_at": 2.0,
        "profile": {"tflops": 1.0, "memory_bytes": 2},
        "links": [],
        "held": held,
    }
    with pytest.raises(ProtocolError, match=why.replace("[", r"\[").replace("]", r"\]")):
        decode(canonical_pack(m))
