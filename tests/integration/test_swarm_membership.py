"""Four real daemons on loopback: they meet, profile, probe, and leave (SIGTERM) or crash (SIGKILL) visibly.

The four daemons are started once for the module. The read-only scenarios (``whole_swarm``)
need all four and come first; each scenario that ends a daemon ends its own one (peer1,
peer2 or peer3; peer0 always stays) and judges only by the daemons still running, so those
scenarios pass in any order or alone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from peerd.localswarm import LocalPeer, LocalSwarm, _session_members, converged, describe

pytestmark = pytest.mark.integration

TTL = 8.0
REFRESH = 1.5
NAMES = ["peer0", "peer1", "peer2", "peer3"]


def _rows(view: dict) -> dict[str, dict]:
    return {p["name"]: p for p in view["peers"]}


def _status_json(peerd_cli, *args: str) -> dict:
    result = peerd_cli("status", "--json", *args, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _observers(swarm: LocalSwarm, victim: LocalPeer) -> list[str]:
    return [p.name for p in swarm.live_peers() if p is not victim]


def _seen_by(views: dict, observers: list[str], name: str, state: str) -> bool:
    return all(n in views and _rows(views[n]).get(name, {}).get("state") == state for n in observers)


@pytest.fixture(scope="module")
def swarm(module_local_swarm) -> LocalSwarm:
    swarm = module_local_swarm(4, record_ttl=TTL, refresh_interval=REFRESH, probe_budget=3)
    swarm.wait_until(
        lambda v: converged(v, NAMES), timeout=60, what="4 peers to meet and measure their links"
    )
    return swarm


@pytest.fixture
def whole_swarm(swarm: LocalSwarm) -> LocalSwarm:
    """The module's swarm with all four daemons still running (the read-only scenarios need them)."""
    stopped = [p.name for p in swarm.peers if not p.alive]
    assert not stopped, (
        f"{stopped} already stopped: read-only scenarios must run before the ones that end peers"
    )
    return swarm


def test_every_daemon_sees_all_four_online_with_profiles_and_links(whole_swarm, peerd_cli):
    """Asked through the real CLI, each daemon lists all four ONLINE with TFLOPS and a full link matrix."""
    ids = {}
    for peer in whole_swarm.peers:
        view = _status_json(peerd_cli, "--home", str(peer.home))
        rows = _rows(view)
        assert set(rows) == set(NAMES), describe({peer.name: view})
        assert view["self"]["name"] == peer.name and view["self"]["state"] == "online"
        assert rows[peer.name]["self"] is True
        for name, row in rows.items():
            assert row["state"] == "online"
            assert row["tflops"]["fp32"] > 0
            assert row["memory_total_bytes"] > 0
            assert row["device_kind"] == "cpu"
            assert row["last_seen_s"] < TTL
            ids[name] = row["peer_id"]
        measured = {(x["src"], x["dst"]): x for x in view["links"] if x["status"] == "ok"}
        for a in ids.values():
            for b in ids.values():
                if a != b:
                    link = measured[(a, b)]
                    assert link["rtt_ms"] > 0 and link["bw_up_mbps"] > 0 and link["bw_down_mbps"] > 0


def test_direct_client_reads_the_table_through_a_bootstrap_peer(whole_swarm, peerd_cli):
    """The short-lived client path (no local daemon) reads the same table through a bootstrap peer."""
    direct = _status_json(peerd_cli, "--direct", "--initial-peers", whole_swarm.peers[0].info.maddrs[0])
    assert direct["self"] is None
    assert {r["name"]: r["state"] for r in direct["peers"]} == dict.fromkeys(NAMES, "online")


def test_garbage_on_the_control_socket_gets_an_error_reply(swarm):
    """Garbage on a daemon's control socket gets an error reply and does not disturb it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(swarm.peers[0].control_socket))
        sock.sendall(b"\x00\xffnot json at all\n")
        reply = json.loads(sock.makefile("rb").readline())
    assert reply["ok"] is False and reply["error"]["name"] == "MALFORMED"
    assert swarm.peers[0].status()["self"]["state"] == "online"


@pytest.mark.parametrize(("sig", "index"), [(signal.SIGTERM, 3), (signal.SIGINT, 1)], ids=["term", "int"])
def test_a_stopped_peer_announces_offline_and_the_others_show_it(swarm, sig, index):
    """SIGTERM, and SIGINT (what Ctrl-C in a terminal sends): the peer leaves, announcing OFFLINE on its way out."""
    victim = swarm.peers[index]
    observers, name = _observers(swarm, victim), victim.name
    assert swarm.stop_peer(victim, sig=sig) == 0
    log = victim.log_tail(40)
    # a signal is a leave: work is handed over (none here) within leave_grace_s, then OFFLINE
    assert "leaving: handing this peer's work over for at most 60 s" in log and "announced OFFLINE" in log
    # Only an announcement shows OFFLINE: a record that just stopped being refreshed stays
    # ONLINE until it expires and then vanishes. The timeout is a hang guard.
    swarm.wait_until(
        lambda v: _seen_by(v, observers, name, "offline"), timeout=30, what=f"{name} to show as OFFLINE"
    )


def test_a_crashed_peer_stays_listed_until_its_record_expires(swarm):
    """SIGKILL: no goodbye; the record stays until its TTL runs out, then it is gone everywhere."""
    victim = swarm.peers[2]
    observers, name = _observers(swarm, victim), victim.name
    os.kill(victim.pid, signal.SIGKILL)
    right_after = swarm.statuses()
    # The daemon's DHT process notices that its parent is gone and takes p2pd down with it.
    deadline = time.monotonic() + 30  # a hang guard
    while _session_members(victim.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_members(victim.pid) == [], "the killed daemon left processes behind"
    swarm.kill_peer(victim)  # reap it

    # Each observer's verdict is judged against the expiration of the entry it last saw (DHT time,
    # from its own status view), not against how long this test happened to wait.
    expires_at: dict[str, float] = {}
    gone_at: dict[str, float] = {}

    def track(views: dict) -> bool:
        for observer in observers:
            if observer in gone_at or observer not in views:
                continue
            row = _rows(views[observer]).get(name)
            if row is None:
                gone_at[observer] = views[observer]["now"]
            else:
                expires_at[observer] = views[observer]["now"] + row["expires_in_s"]
        return set(gone_at) == set(observers)

    still_listed = {n: name in _rows(right_after[n]) for n in observers if n in right_after}
    assert still_listed == dict.fromkeys(observers, True), still_listed  # soft state: not visible at once...
    track(right_after)
    swarm.wait_until(track, timeout=TTL + 30, what=f"{name}'s record to expire")
    # ...only when the last refresh expires (1 ms: expires_in_s is rounded to ms)
    early = {n: round(expires_at[n] - gone_at[n], 3) for n in observers if gone_at[n] < expires_at[n] - 1e-3}
    assert not early, f"dropped before its expiration (seconds early): {early}"
