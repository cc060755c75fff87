"""Four real daemons on loopback: they meet, profile, probe, and leave (SIGTERM) or crash (SIGKILL) visibly."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from peerd.localswarm import _session_members, converged, describe

pytestmark = pytest.mark.integration

TTL = 8.0
REFRESH = 1.5


def _rows(view: dict) -> dict[str, dict]:
    return {p["name"]: p for p in view["peers"]}


def _status_json(peerd_cli, *args: str) -> dict:
    result = peerd_cli("status", "--json", *args, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_four_daemons_meet_leave_and_crash(local_swarm, peerd_cli):
    swarm = local_swarm(4, record_ttl=TTL, refresh_interval=REFRESH, probe_budget=3)
    names = [p.name for p in swarm.peers]
    swarm.wait_until(
        lambda v: converged(v, names), timeout=60, what="4 peers to meet and measure their links"
    )

    # -- every daemon, asked through the real CLI, sees all four ONLINE with TFLOPS and a full link matrix
    ids = {}
    for peer in swarm.peers:
        view = _status_json(peerd_cli, "--home", str(peer.home))
        rows = _rows(view)
        assert set(rows) == set(names), describe({peer.name: view})
        assert view["self"]["name"] == peer.name and view["self"]["state"] == "online"
        assert rows[peer.name]["self"] is True
        for row in rows.values():
            assert row["state"] == "online"
            assert row["tflops"]["fp32"] > 0
            assert row["memory_total_bytes"] > 0
            assert row["device_kind"] == "cpu"
            assert row["last_seen_s"] < TTL
            ids[row["name"]] = row["peer_id"]
        measured = {(x["src"], x["dst"]): x for x in view["links"] if x["status"] == "ok"}
        for a in ids.values():
            for b in ids.values():
                if a != b:
                    link = measured[(a, b)]
                    assert link["rtt_ms"] > 0 and link["bw_up_mbps"] > 0 and link["bw_down_mbps"] > 0

    # -- the short-lived client path (no local daemon) reads the same table through a bootstrap peer
    direct = _status_json(peerd_cli, "--direct", "--initial-peers", swarm.peers[0].info.maddrs[0])
    assert direct["self"] is None
    assert {r["name"]: r["state"] for r in direct["peers"]} == dict.fromkeys(names, "online")

    # -- garbage on a daemon's control socket gets an error reply and does not disturb it
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(swarm.peers[1].control_socket))
        sock.sendall(b"\x00\xffnot json at all\n")
        reply = json.loads(sock.makefile("rb").readline())
    assert reply["ok"] is False and reply["error"]["name"] == "MALFORMED"
    assert swarm.peers[1].status()["self"]["state"] == "online"

    # -- SIGTERM: the peer announces OFFLINE on its way out; the others show it at once
    t0 = time.monotonic()
    assert swarm.stop_peer(3) == 0
    assert "announced OFFLINE" in swarm.peers[3].log_tail(40)
    swarm.wait_until(
        lambda v: all(_rows(v[n]).get("peer3", {}).get("state") == "offline" for n in names[:3]),
        timeout=REFRESH + 3,
        what="peer3 to show as OFFLINE",
    )
    assert time.monotonic() - t0 < REFRESH + 10

    # -- SIGKILL: no goodbye; the record stays until its TTL runs out, then it is gone everywhere
    victim = swarm.peers[2]
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    # The daemon's DHT process notices that its parent is gone and takes p2pd down with it.
    deadline = time.monotonic() + 10
    while _session_members(victim.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_members(victim.pid) == [], "the killed daemon left processes behind"
    swarm.kill_peer(victim)  # reap it
    still_listed = {name: "peer2" in _rows(view) for name, view in swarm.statuses().items()}
    swarm.wait_until(
        lambda v: set(v) == {"peer0", "peer1"} and all("peer2" not in _rows(view) for view in v.values()),
        timeout=TTL + 15,
        what="peer2's record to expire",
    )
    gone_after = time.monotonic() - killed_at
    assert all(still_listed.values()), still_listed  # soft state: a crash is not visible at once...
    assert gone_after >= TTL - REFRESH - 1.0, gone_after  # ...only when the last refresh expires
    assert gone_after <= TTL + 15

    # -- SIGINT works like SIGTERM (what Ctrl-C in a terminal sends)
    assert swarm.stop_peer(1, sig=signal.SIGINT) == 0
    assert "announced OFFLINE" in swarm.peers[1].log_tail(40)
