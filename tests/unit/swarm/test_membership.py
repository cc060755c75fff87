"""Membership reader and status view, on real signed-record bytes: what is kept, what is dropped, and why."""

from __future__ import annotations

import logging

import pytest
from hivemind.utils.timed_storage import ValueWithExpiration
from msgspec.structs import replace

from peerd.swarm.identity import Identity
from peerd.swarm.membership import merge_peer_entries, parse_peer_entries, peers_view, short_id
from peerd.swarm.records import (
    DeviceKind,
    DeviceProfile,
    LinkMeasurement,
    LinkStatus,
    PeerRecord,
    PeerState,
    encode_peer_record,
)

NOW = 1_800_000_000.0


@pytest.fixture(scope="module")
def identities() -> list[Identity]:
    return [Identity.generate() for _ in range(3)]


def _record(identity: Identity, name: str, *, seq: int = 1, updated: float = NOW - 1, **kw) -> PeerRecord:
    return PeerRecord(
        peer_id=identity.peer_id,
        name=name,
        state=kw.pop("state", PeerState.ONLINE),
        maddrs=[f"/ip4/127.0.0.1/tcp/4000/p2p/{identity.peer_id}"],
        profile=DeviceProfile(
            name="cpu",
            kind=DeviceKind.CPU,
            memory_total_bytes=8 << 30,
            memory_free_bytes=4 << 30,
            tflops={"fp32": 0.5, "bf16": 1.0},
            measured_at=NOW - 100,
        ),
        software_version="0.1.0",
        started_at=NOW - 200,
        updated_at=updated,
        seq=seq,
        **kw,
    )


def _entry(record: PeerRecord, expires: float = NOW + 30) -> ValueWithExpiration:
    return ValueWithExpiration(encode_peer_record(record), expires)


def test_valid_entries_are_kept_and_sorted_by_name(identities):
    a, b, _ = identities
    value = {b.owner_tag: _entry(_record(b, "beta")), a.owner_tag: _entry(_record(a, "alpha"))}
    entries = parse_peer_entries(value, now=NOW)
    assert [e.record.name for e in entries] == ["alpha", "beta"]
    assert entries[0].expires_at == NOW + 30


def test_expired_entries_are_dropped_quietly(identities, caplog):
    a, b, _ = identities
    value = {
        a.owner_tag: _entry(_record(a, "alpha"), expires=NOW - 0.1),
        b.owner_tag: _entry(_record(b, "beta")),
    }
    with caplog.at_level(logging.INFO, logger="peerd.swarm.membership"):
        entries = parse_peer_entries(value, now=NOW)
    assert [e.record.name for e in entries] == ["beta"]
    assert "skipping" not in caplog.text  # expiry is normal, not an error


def test_bad_entries_are_skipped_and_logged(identities, caplog):
    a, b, c = identities
    good = _entry(_record(c, "gamma"))
    value = {
        a.owner_tag: ValueWithExpiration(b"\x93not a record", NOW + 30),  # malformed bytes
        b.owner_tag: _entry(_record(a, "impostor")),  # a's record stored under b's key
        b"plain-subkey": good,  # not an owner tag
        c.owner_tag: good,
    }
    with caplog.at_level(logging.INFO, logger="peerd.swarm.membership"):
        entries = parse_peer_entries(value, now=NOW)
    assert [e.record.name for e in entries] == ["gamma"]
    assert caplog.text.count("skipping peer entry") == 3


def test_future_records_are_rejected(identities):
    a = identities[0]
    value = {a.owner_tag: _entry(_record(a, "alpha", updated=NOW + 120), expires=NOW + 150)}
    assert parse_peer_entries(value, now=NOW) == []


def test_non_dictionary_value_yields_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="peerd.swarm.membership"):
        assert parse_peer_entries(b"someone stored bytes here", now=NOW) == []
    assert "not a subkey dictionary" in caplog.text


def test_view_rows_and_links(identities):
    a, b, _ = identities
    link = LinkMeasurement(
        peer_id=b.peer_id, rtt_ms=1.5, bw_up_mbps=100.0, bw_down_mbps=90.0, measured_at=NOW - 2
    )
    dead = LinkMeasurement(peer_id=identities[2].peer_id, measured_at=NOW - 3, status=LinkStatus.UNREACHABLE)
    rec_a = _record(a, "alpha", links=[link, dead])
    rec_b = replace(_record(b, "beta", state=PeerState.OFFLINE), profile=None)
    value = {a.owner_tag: _entry(rec_a), b.owner_tag: _entry(rec_b, expires=NOW + 5)}
    view = peers_view(parse_peer_entries(value, now=NOW), now=NOW, self_id=a.peer_id)
    rows = {p["name"]: p for p in view["peers"]}
    assert rows["alpha"]["self"] and not rows["beta"]["self"]
    assert rows["alpha"]["tflops"] == {"fp32": 0.5, "bf16": 1.0}
    assert rows["alpha"]["memory_free_bytes"] == 4 << 30
    assert rows["alpha"]["last_seen_s"] == pytest.approx(1.0)
    assert rows["alpha"]["short_id"] == short_id(a.peer_id) == a.peer_id[-8:]
    assert (
        rows["beta"]["state"] == "offline" and rows["beta"]["device"] is None and rows["beta"]["tflops"] == {}
    )
    assert rows["beta"]["expires_in_s"] == pytest.approx(5.0)
    links = {(x["src"], x["dst"]): x for x in view["links"]}
    assert links[(a.peer_id, b.peer_id)]["rtt_ms"] == 1.5
    assert links[(a.peer_id, b.peer_id)]["age_s"] == pytest.approx(2.0)
    assert links[(a.peer_id, identities[2].peer_id)]["status"] == "unreachable"


def test_status_rendering_fills_the_matrix_from_either_side(identities):
    """The CLI's link matrix: row -> column from the row's record, or the reverse measurement if only that exists."""
    from peerd.cli.render import link_cells, render_status

    a, b, _ = identities
    link = LinkMeasurement(
        peer_id=b.peer_id, rtt_ms=2.0, bw_up_mbps=100.0, bw_down_mbps=50.0, measured_at=NOW - 2
    )
    value = {a.owner_tag: _entry(_record(a, "alpha", links=[link])), b.owner_tag: _entry(_record(b, "beta"))}
    view = peers_view(parse_peer_entries(value, now=NOW), now=NOW)
    cells = link_cells(view)
    assert cells[(a.peer_id, b.peer_id)] == "2.0 / 100"
    assert cells[(b.peer_id, a.peer_id)] == "2.0 / 50"  # beta -> alpha, as alpha measured its download
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render_status(view))
    text = console.export_text()
    assert "alpha" in text and "ONLINE" in text and "2.0 / 100" in text


def test_a_read_that_finds_an_older_copy_does_not_drop_the_newer_one_seen(identities):
    """The crashed peer's newest refresh lived on its own DHT node: a later read finds an older copy
    that expires sooner. The list keeps the newest seen until its own expiration, then drops it."""
    a, b, _ = identities
    newest = parse_peer_entries({a.owner_tag: _entry(_record(a, "alpha", seq=5), expires=NOW + 30)}, now=NOW)
    known = merge_peer_entries({}, newest, now=NOW)
    older = parse_peer_entries(
        {
            a.owner_tag: _entry(_record(a, "alpha", seq=4, updated=NOW - 10), expires=NOW + 10),
            b.owner_tag: _entry(_record(b, "beta")),
        },
        now=NOW,
    )
    known = merge_peer_entries(known, older, now=NOW + 1)
    assert {pid: e.record.seq for pid, e in known.items()} == {a.peer_id: 5, b.peer_id: 1}
    assert known[a.peer_id].expires_at == NOW + 30
    assert a.peer_id in merge_peer_entries(known, [], now=NOW + 29)  # missed by a read: still listed
    later = merge_peer_entries(known, [], now=NOW + 30)  # its newest copy expired: gone
    assert a.peer_id not in later and b.peer_id not in later


def test_a_newer_record_replaces_the_one_seen(identities):
    a, _, _ = identities
    first = parse_peer_entries({a.owner_tag: _entry(_record(a, "alpha", seq=1))}, now=NOW)
    offline = parse_peer_entries(
        {a.owner_tag: _entry(_record(a, "alpha", seq=2, updated=NOW, state=PeerState.OFFLINE))}, now=NOW
    )
    known = merge_peer_entries(merge_peer_entries({}, first, now=NOW), offline, now=NOW)
    assert known[a.peer_id].record.state == PeerState.OFFLINE
