"""Bootstrap through real daemons on loopback: the swarm outlives its first peer, and a restart needs no address.

Each test starts its own small swarm (peer0 starts it, the others join through peer0) and
judges by what the surviving daemons report through their control sockets.
"""

from __future__ import annotations

import json
import time

import pytest

from peerd.localswarm import LocalPeer, LocalSwarm, converged
from peerd.swarm.membership import KNOWN_PEERS_FILE

pytestmark = pytest.mark.integration


def _online(view: dict) -> set[str]:
    return {p["name"] for p in view["peers"] if p["state"] == "online"}


def _everyone_sees(names: set[str]):
    """A ``wait_until`` predicate: each of ``names`` answers and lists all of ``names`` ONLINE."""
    return lambda views: all(n in views and names <= _online(views[n]) for n in names)


def _remembered(peer: LocalPeer) -> set[str]:
    try:
        doc = json.loads((peer.home / KNOWN_PEERS_FILE).read_text())
    except (OSError, ValueError):
        return set()
    return {p["peer_id"] for p in doc["peers"]}


def test_the_swarm_outlives_its_first_peer(local_swarm):
    """SIGKILL the bootstrap peer: the others carry on, and a newcomer joins through any survivor."""
    swarm = local_swarm(3, probe_budget=0)
    swarm.wait_until(
        lambda v: converged(v, ["peer0", "peer1", "peer2"], links=False), 45, what="3 peers to meet"
    )
    dead = swarm.peers[0].info.maddrs
    swarm.kill_peer(0)

    # several initial peers, the first of them dead: any one that answers is enough
    newcomer = swarm.add_peer("peer3", initial_peers=[*dead, *swarm.peers[1].info.maddrs])
    survivors = {"peer1", "peer2", "peer3"}
    swarm.wait_until(_everyone_sees(survivors), 30, what="the survivors and the newcomer to see each other")
    assert newcomer.status()["self"]["state"] == "online"


def test_a_restarted_peer_rejoins_through_the_peers_it_remembers(local_swarm, wait_until):
    """With the bootstrap peer dead, a peer restarted without --initial-peers finds the swarm through its home."""
    swarm = local_swarm(3, probe_budget=0)
    ids = {p.name: p.info.peer_id for p in swarm.peers}
    peer2 = swarm.peers[2]
    wait_until(
        lambda: _remembered(peer2) == {ids["peer0"], ids["peer1"]},
        30,
        "peer2 to remember peer0 and peer1",
        detail=lambda: (peer2.home / KNOWN_PEERS_FILE).read_text(errors="replace"),
    )
    swarm.kill_peer(0)  # the address every peer was started with is gone
    assert swarm.stop_peer(peer2) == 0

    swarm.restart_peer(peer2)  # no --initial-peers: only the remembered peer0 (dead) and peer1
    assert "bootstrapping through 0 configured and 2 remembered peers" in peer2.log_tail(200)
    views = swarm.wait_until(_everyone_sees({"peer1", "peer2"}), 30, what="peer2 back beside peer1")
    assert views["peer2"]["self"]["peer_id"] == ids["peer2"]  # the same identity, from the same home


def test_a_peer_whose_remembered_peers_are_all_gone_starts_on_its_own(tmp_path, profile_cache):
    """Nobody remembered answers and no initial peer is configured: the daemon starts anyway, reachable again."""
    home = tmp_path / "alone" / "peer0"
    home.mkdir(parents=True)
    gone = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    doc = {
        "kind": "peerd-known-peers",
        "version": 1,
        "swarm": "default",
        "peers": [{"peer_id": gone, "maddrs": [f"/ip4/127.0.0.1/tcp/9/p2p/{gone}"], "seen_at": time.time()}],
    }
    (home / KNOWN_PEERS_FILE).write_text(json.dumps(doc))
    options = {"device": "cpu", "profile_cache": str(profile_cache), "probe_budget": 0}
    with LocalSwarm(1, tmp_path / "alone", options=options, ready_timeout=90) as swarm:
        peer = swarm.peers[0]
        assert peer.status()["self"]["state"] == "online"
        assert "none of the 1 remembered peers answered; starting on our own" in peer.log_tail(200)
