"""Peer record codec: round trips, canonical bytes, tolerance, rejection codes, freshness, trimming to fit."""

from __future__ import annotations

import math

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerd.errors import ErrorCode, ProtocolError
from peerd.swarm.records import (
    MAX_CLOCK_SKEW_S,
    MAX_LINKS,
    MAX_PEER_RECORD_BYTES,
    PEER_RECORD_MAX_TTL_S,
    DeviceKind,
    DeviceProfile,
    LinkMeasurement,
    LinkStatus,
    PeerRecord,
    PeerState,
    check_record_time,
    decode_peer_record,
    encode_peer_record,
    fit_peer_record,
    peer_record_to_wire,
    validate_peer_record,
)
from peerd.wire import canonical_pack

NOW = 1_800_000_000.0
PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
OTHER = "QmNYG4mfj1dhLZBYBWEFyhYC2S2QDHZ8Ra5K7XKqtqBLAd"


B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def peer_id(i: int) -> str:
    """A distinct well-formed base58 id per ``i``."""
    digits = ""
    while True:
        i, r = divmod(i, 58)
        digits = B58[r] + digits
        if i == 0:
            break
    return "Qm" + digits.rjust(44, "1")  # "1" is base58's zero digit: padding cannot collide


def record(**changes) -> PeerRecord:
    rec = PeerRecord(
        peer_id=PEER,
        name="box",
        state=PeerState.ONLINE,
        maddrs=["/ip4/127.0.0.1/tcp/4001"],
        profile=DeviceProfile(
            name="cpu",
            kind=DeviceKind.CPU,
            memory_total_bytes=1 << 34,
            memory_free_bytes=1 << 33,
            tflops={"fp32": 0.2, "bf16": 0.4},
            measured_at=NOW - 100,
        ),
        links=[
            LinkMeasurement(
                peer_id=OTHER, rtt_ms=80.0, bw_up_mbps=20.0, bw_down_mbps=19.0, measured_at=NOW - 5
            )
        ],
        software_version="0.1.0",
        started_at=NOW - 200,
        updated_at=NOW,
        seq=4,
    )
    return msgspec.structs.replace(rec, **changes)


def test_round_trip_and_types():
    rec = record()
    raw = encode_peer_record(rec)
    back = decode_peer_record(raw)
    assert back == rec
    assert isinstance(back.state, PeerState) and isinstance(back.profile.kind, DeviceKind)
    assert isinstance(back.links[0].status, LinkStatus)
    assert len(raw) < 1024  # the usual record is small; the limit is for big swarms


def test_encoding_is_canonical_regardless_of_construction_order():
    a = record(profile=msgspec.structs.replace(record().profile, tflops={"bf16": 0.4, "fp32": 0.2}))
    b = record(profile=msgspec.structs.replace(record().profile, tflops={"fp32": 0.2, "bf16": 0.4}))
    assert encode_peer_record(a) == encode_peer_record(b)
    # integers given for float fields are written as float64, so equal records have equal bytes
    assert encode_peer_record(record(updated_at=int(NOW))) == encode_peer_record(record(updated_at=NOW))
    top = msgpack.unpackb(encode_peer_record(a))
    assert list(top) == sorted(top) and list(top["profile"]) == sorted(top["profile"])


def test_optional_fields_are_omitted_not_nil():
    rec = record(
        profile=None, links=[LinkMeasurement(peer_id=OTHER, measured_at=NOW, status=LinkStatus.UNREACHABLE)]
    )
    wire = msgpack.unpackb(encode_peer_record(rec))
    assert "profile" not in wire
    assert set(wire["links"][0]) == {"peer_id", "measured_at", "status"}
    assert decode_peer_record(encode_peer_record(rec)) == rec


def test_unknown_fields_are_tolerated_at_every_level():
    wire = peer_record_to_wire(record())
    wire["new_thing"] = {"nested": [1, 2]}
    wire["profile"]["numa"] = 2
    wire["links"][0]["loss"] = 0.01
    assert decode_peer_record(msgpack.packb(wire)) == record()


@pytest.mark.parametrize(
    ("rec", "code"),
    [
        (record(version=2), ErrorCode.UNSUPPORTED_VERSION),
        (record(seq=-1), ErrorCode.MALFORMED),
        (record(peer_id="not base58!"), ErrorCode.MALFORMED),
        (record(started_at=NOW + 1), ErrorCode.MALFORMED),
        (
            record(profile=msgspec.structs.replace(record().profile, tflops={"fp32": math.nan})),
            ErrorCode.MALFORMED,
        ),
        (
            record(
                links=[LinkMeasurement(peer_id=peer_id(i), measured_at=NOW) for i in range(MAX_LINKS + 1)]
            ),
            ErrorCode.OVERSIZED,
        ),
        (record(name="x" * 129), ErrorCode.MALFORMED),
        (record(seq=2**70), ErrorCode.MALFORMED),  # beyond msgpack's 64-bit integers
        (record(state="bogus"), ErrorCode.MALFORMED),
        (record(profile=msgspec.structs.replace(record().profile, host_id="Box-1")), ErrorCode.MALFORMED),
        (record(profile=msgspec.structs.replace(record().profile, host_cores=0)), ErrorCode.MALFORMED),
    ],
)
def test_encoder_refuses_what_peers_would_reject(rec: PeerRecord, code: ErrorCode):
    with pytest.raises(ProtocolError) as info:
        encode_peer_record(rec)
    assert info.value.code == code


@pytest.mark.parametrize("raw", [None, "text", 5, [b"\x80"]])
def test_non_bytes_input_is_malformed(raw):
    with pytest.raises(ProtocolError) as info:
        decode_peer_record(raw)
    assert info.value.code == ErrorCode.MALFORMED


def test_size_limit_is_checked_before_parsing():
    with pytest.raises(ProtocolError) as info:
        decode_peer_record(b"\xc1" * (MAX_PEER_RECORD_BYTES + 1))
    assert info.value.code == ErrorCode.OVERSIZED


def test_deep_nesting_is_malformed_not_a_crash():
    wire = peer_record_to_wire(record())
    deep: object = 0
    for _ in range(5000):
        deep = [deep]
    wire["extra"] = deep
    with pytest.raises(ProtocolError):
        decode_peer_record(_pack_deep(wire))


def _pack_deep(wire: dict) -> bytes:
    # msgpack-python refuses to *pack* very deep objects, so build the bytes by hand: 5000 x fixarray(1)
    body = msgpack.packb({k: v for k, v in wire.items() if k != "extra"})
    n = len(wire) - 1
    assert n < 16
    return bytes([0x80 | (n + 1)]) + body[1:] + msgpack.packb("extra") + b"\x91" * 5000 + b"\x00"


# ---------------------------------------------------------------- freshness


def test_time_checks_at_the_skew_boundary():
    rec = record(updated_at=NOW)
    check_record_time(rec, NOW - MAX_CLOCK_SKEW_S)  # exactly at the allowance: accepted
    with pytest.raises(ProtocolError) as info:
        check_record_time(rec, NOW - MAX_CLOCK_SKEW_S - 0.01)
    assert info.value.code == ErrorCode.FROM_FUTURE


def test_profile_and_link_timestamps_are_checked_too():
    future_profile = record(profile=msgspec.structs.replace(record().profile, measured_at=NOW + 60))
    with pytest.raises(ProtocolError) as info:
        check_record_time(future_profile, NOW)
    assert info.value.code == ErrorCode.FROM_FUTURE and "profile" in str(info.value)


def test_stale_and_ttl_limits():
    rec = record()
    check_record_time(rec, NOW + PEER_RECORD_MAX_TTL_S, expiration_time=NOW + PEER_RECORD_MAX_TTL_S)
    with pytest.raises(ProtocolError) as info:
        check_record_time(rec, NOW + PEER_RECORD_MAX_TTL_S + MAX_CLOCK_SKEW_S + 1)
    assert info.value.code == ErrorCode.STALE
    with pytest.raises(ProtocolError) as info:
        check_record_time(rec, NOW, expiration_time=NOW + PEER_RECORD_MAX_TTL_S + MAX_CLOCK_SKEW_S + 1)
    assert info.value.code == ErrorCode.FROM_FUTURE


def test_validate_combines_decode_and_time():
    raw = encode_peer_record(record())
    assert validate_peer_record(raw, NOW + 1, expiration_time=NOW + 30) == record()
    with pytest.raises(ProtocolError) as info:
        validate_peer_record(raw, NOW - 3600)
    assert info.value.code == ErrorCode.FROM_FUTURE


# ---------------------------------------------------------------- fitting big swarms


def test_fit_keeps_the_newest_links_within_the_limits():
    links = [
        LinkMeasurement(peer_id=peer_id(i), rtt_ms=float(i), measured_at=NOW - 1000 + i) for i in range(200)
    ]
    many_addrs = [f"/ip4/10.0.0.{i}/tcp/4001/p2p/{PEER}" for i in range(16)]
    rec = record(links=links, maddrs=many_addrs)
    with pytest.raises(ProtocolError):
        encode_peer_record(rec)
    fitted = fit_peer_record(rec)
    raw = encode_peer_record(fitted)
    assert len(raw) <= MAX_PEER_RECORD_BYTES and 0 < len(fitted.links) <= MAX_LINKS
    kept = [link.measured_at for link in fitted.links]
    dropped = {link.measured_at for link in links} - set(kept)
    assert min(kept) > max(dropped)  # only the oldest went
    assert fit_peer_record(record()) == record()


# ---------------------------------------------------------------- properties

names = st.text(max_size=40)
finite = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
links_st = st.lists(
    st.builds(
        LinkMeasurement,
        peer_id=st.integers(0, 10_000).map(peer_id),
        rtt_ms=st.none() | finite,
        bw_up_mbps=st.none() | finite,
        bw_down_mbps=st.none() | finite,
        measured_at=st.floats(NOW - 100, NOW),
        status=st.sampled_from(LinkStatus),
    ),
    max_size=8,
    unique_by=lambda link: link.peer_id,
)
profiles = st.none() | st.builds(
    DeviceProfile,
    name=names,
    kind=st.sampled_from(DeviceKind),
    memory_total_bytes=st.integers(0, 2**50),
    memory_free_bytes=st.none() | st.integers(0, 2**50),
    tflops=st.dictionaries(st.sampled_from(["fp32", "bf16", "fp16", "tf32"]), finite),
    measured_at=st.floats(NOW - 1000, NOW),
    host_id=st.none() | st.text("0123456789abcdef", min_size=16, max_size=16),
    host_cores=st.none() | st.integers(1, 1 << 20),
    threads=st.none() | st.integers(1, 1 << 20),
)


@settings(max_examples=150, deadline=None)
@given(
    name=names,
    state=st.sampled_from(PeerState),
    profile=profiles,
    links=links_st,
    seq=st.integers(0, 2**63),
    started=st.floats(NOW - 1e5, NOW),
)
def test_any_valid_record_round_trips_byte_exactly(name, state, profile, links, seq, started):
    rec = record(name=name, state=state, profile=profile, links=links, seq=seq, started_at=started)
    raw = encode_peer_record(rec)
    assert decode_peer_record(raw) == rec
    assert encode_peer_record(decode_peer_record(raw)) == raw


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_corrupted_bytes_only_ever_raise_protocol_error(data):
    raw = bytearray(encode_peer_record(record()))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(raw)))
    try:
        decode_peer_record(bytes(raw[:cut]))
    except ProtocolError as exc:
        assert exc.code in {
            ErrorCode.MALFORMED,
            ErrorCode.OVERSIZED,
            ErrorCode.UNSUPPORTED_VERSION,
            ErrorCode.UNKNOWN_KIND,
        }


def test_nil_in_a_defaulted_list_reads_as_absent_and_nil_in_a_required_field_as_missing():
    wire = peer_record_to_wire(record())
    assert decode_peer_record(canonical_pack({**wire, "maddrs": None, "links": None})).maddrs == []
    with pytest.raises(ProtocolError, match="seq") as info:
        decode_peer_record(canonical_pack({**wire, "seq": None}))
    assert info.value.code == ErrorCode.MALFORMED


def test_link_measurements_are_built_and_read_in_si_units_and_carry_ms_and_mbps():
    link = LinkMeasurement.from_si(
        "QmNYG4mfj1dhLZBYBWEFyhYC2S2QDHZ8Ra5K7XKqtqBLAd",
        rtt_s=0.0815,
        bw_up_bps=19.6e6,
        bw_down_bps=None,
        measured_at=NOW,
    )
    assert (link.rtt_ms, link.bw_up_mbps, link.bw_down_mbps) == pytest.approx((81.5, 19.6, None))
    assert (link.rtt_s, link.bw_up_bps, link.bw_down_bps) == pytest.approx((0.0815, 19.6e6, None))
