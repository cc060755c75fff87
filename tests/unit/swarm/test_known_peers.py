"""The remembered peers in PEERD_HOME: what is kept and in which order, the atomic file, and bad files ignored."""

from __future__ import annotations

import json
import logging
import os

import pytest

from peerd.swarm.membership import (
    KNOWN_PEER_MAX_AGE_S,
    MAX_KNOWN_PEERS,
    MAX_KNOWN_PEERS_BYTES,
    MAX_MADDRS_PER_PEER,
    RESAVE_S,
    KnownPeer,
    KnownPeersStore,
    bootstrap_peers,
    remember_peers,
)
from peerd.swarm.records import PeerRecord, PeerState

NOW = 1_800_000_000.0
# well-formed base58 peer ids (the store never parses them; p2pd does, at start)
IDS = [f"QmPeer{i:040d}" for i in range(40)]
ME = "QmMe" + "x" * 42


def _record(peer_id: str, *maddrs: str, state: PeerState = PeerState.ONLINE) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        name="p",
        state=state,
        maddrs=list(maddrs) or [f"/ip4/127.0.0.1/tcp/4000/p2p/{peer_id}"],
        software_version="0.1.0",
        started_at=NOW - 10,
        updated_at=NOW,
        seq=1,
    )


def test_addresses_end_in_their_peer_id_and_foreign_ones_are_dropped():
    a = IDS[0]
    record = _record(
        a,
        "/ip4/10.0.0.1/tcp/1",  # no /p2p/: appended
        f"/ip4/10.0.0.2/tcp/2/p2p/{a}",
        f"/ip4/10.0.0.3/tcp/3/p2p/{IDS[1]}",  # another peer's id: not an address of a
        f"/ip4/10.0.0.2/tcp/2/p2p/{a}",  # a duplicate
    )
    (peer,) = remember_peers((), [record], self_id=ME, now=NOW)
    assert peer.maddrs == (f"/ip4/10.0.0.1/tcp/1/p2p/{a}", f"/ip4/10.0.0.2/tcp/2/p2p/{a}")
    many = _record(a, *(f"/ip4/10.0.0.{i}/tcp/1" for i in range(20)))
    assert len(remember_peers((), [many], self_id=ME, now=NOW)[0].maddrs) == MAX_MADDRS_PER_PEER


def test_newest_first_without_self_bounded_and_stale_ones_forgotten():
    old = KnownPeer(IDS[0], (f"/ip4/10.0.0.1/tcp/1/p2p/{IDS[0]}",), NOW - KNOWN_PEER_MAX_AGE_S - 1)
    kept = KnownPeer(IDS[1], (f"/ip4/10.0.0.1/tcp/1/p2p/{IDS[1]}",), NOW - 60)
    seen = [_record(ME), _record(IDS[2]), _record(IDS[3], state=PeerState.OFFLINE)]
    peers = remember_peers([old, kept], seen, self_id=ME, now=NOW)
    assert [p.peer_id for p in peers] == [IDS[2], IDS[3], IDS[1]]  # seen now (by id), then seen before
    assert peers[0].seen_at == NOW and peers[2] == kept
    crowd = [_record(pid) for pid in IDS]
    assert len(remember_peers(peers, crowd, self_id=ME, now=NOW + 1)) == MAX_KNOWN_PEERS


def test_configured_peers_come_first_and_each_address_once():
    a, b = IDS[:2]
    known = [
        KnownPeer(a, (f"/ip4/10.0.0.1/tcp/1/p2p/{a}",), NOW),
        KnownPeer(b, (f"/ip4/10.0.0.2/tcp/2/p2p/{b}", f"/ip4/10.0.0.9/tcp/9/p2p/{b}"), NOW - 5),
    ]
    configured = [f"/ip4/10.0.0.2/tcp/2/p2p/{b}"]
    assert bootstrap_peers(configured, known) == [
        f"/ip4/10.0.0.2/tcp/2/p2p/{b}",
        f"/ip4/10.0.0.1/tcp/1/p2p/{a}",
        f"/ip4/10.0.0.9/tcp/9/p2p/{b}",
    ]
    assert bootstrap_peers([], []) == []


def test_saved_file_loads_back_in_a_new_store_and_no_temporary_file_is_left(tmp_path):
    path = tmp_path / "known_peers.json"
    store = KnownPeersStore(path, "lab")
    assert store.load() == ()  # no file yet: nothing remembered, nothing said
    assert store.update([_record(IDS[0]), _record(IDS[1])], self_id=ME, now=NOW)
    store.save(NOW)
    assert sorted(os.listdir(tmp_path)) == ["known_peers.json"]
    doc = json.loads(path.read_text())
    assert doc["kind"] == "peerd-known-peers" and doc["version"] == 1 and doc["swarm"] == "lab"
    again = KnownPeersStore(path, "lab")
    assert again.load() == store.peers and len(again.peers) == 2


def test_an_unchanged_list_is_rewritten_only_now_and_then(tmp_path):
    store = KnownPeersStore(tmp_path / "known_peers.json", "lab")
    store.load()
    seen = [_record(IDS[0])]
    assert store.update(seen, self_id=ME, now=NOW)
    store.save(NOW)
    assert not store.update(seen, self_id=ME, now=NOW + 2)  # same peers, same addresses: no write
    assert store.update([*seen, _record(IDS[1])], self_id=ME, now=NOW + 4)  # a newcomer: write
    store.save(NOW + 4)
    assert store.update(seen, self_id=ME, now=NOW + 4 + RESAVE_S)  # refresh the times once in a while
    moved = [_record(IDS[0], "/ip4/10.0.0.7/tcp/7")]
    assert store.update(moved, self_id=ME, now=NOW + 5)  # a peer's new address: write


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"{not json", "not a readable peers list"),
        (
            b'{"kind": "peerd-known-peers", "version": 1, "swarm": "lab", "peers": [{"peer_id": 5}]}',
            "peer_id",
        ),
        (b'{"kind": "ssh-known-hosts", "version": 1, "swarm": "lab"}', "not peerd's remembered peers"),
        (b'{"kind": "peerd-known-peers", "version": 7, "swarm": "lab"}', "format version 7"),
        (b'{"kind": "peerd-known-peers", "version": 1, "swarm": "other"}', "swarm 'other'"),
        (b"[]", "not a readable peers list"),
        (b" " * (MAX_KNOWN_PEERS_BYTES + 1), "larger than"),
    ],
    ids=["corrupt", "wrong-type", "foreign", "newer", "other-swarm", "not-a-map", "oversized"],
)
def test_a_bad_or_foreign_file_is_ignored_with_a_warning(tmp_path, caplog, content, words):
    path = tmp_path / "known_peers.json"
    path.write_bytes(content)
    store = KnownPeersStore(path, "lab")
    with caplog.at_level(logging.WARNING, logger="peerd.swarm.membership"):
        assert store.load() == ()
    assert words in caplog.text and str(path) in caplog.text
    # the next save replaces it with a good file
    store.update([_record(IDS[0])], self_id=ME, now=NOW)
    store.save(NOW)
    assert [p.peer_id for p in KnownPeersStore(path, "lab").load()] == [IDS[0]]


def test_entries_without_a_usable_address_are_dropped_on_load(tmp_path):
    path = tmp_path / "known_peers.json"
    doc = {
        "kind": "peerd-known-peers",
        "version": 1,
        "swarm": "lab",
        "future_field": "ignored within a version",
        "peers": [
            {"peer_id": IDS[0], "maddrs": ["not an address"], "seen_at": NOW},
            {"peer_id": IDS[1], "maddrs": [f"/ip4/10.0.0.1/tcp/1/p2p/{IDS[2]}"], "seen_at": NOW},
            {"peer_id": IDS[3], "maddrs": ["/ip4/10.0.0.1/tcp/1"], "seen_at": NOW},
        ],
    }
    path.write_text(json.dumps(doc))
    (peer,) = KnownPeersStore(path, "lab").load()
    assert peer == KnownPeer(IDS[3], (f"/ip4/10.0.0.1/tcp/1/p2p/{IDS[3]}",), NOW)


def test_a_failed_save_is_a_warning_and_keeps_the_old_file(tmp_path, caplog, monkeypatch):
    path = tmp_path / "known_peers.json"
    store = KnownPeersStore(path, "lab")
    store.update([_record(IDS[0])], self_id=ME, now=NOW)
    store.save(NOW)
    before = path.read_bytes()

    def disk_full(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", disk_full)  # the rename fails (works as root too, unlike chmod)
    store.update([_record(IDS[1])], self_id=ME, now=NOW + 1)
    with caplog.at_level(logging.WARNING, logger="peerd.swarm.membership"):
        store.save(NOW + 1)
    assert "cannot save the remembered peers" in caplog.text
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["known_peers.json"]  # no temporary left behind
    assert store.update([], self_id=ME, now=NOW + 2)  # still unsaved: the next refresh tries again
    monkeypatch.undo()
    store.save(NOW + 2)
    assert len(KnownPeersStore(path, "lab").load()) == 2
