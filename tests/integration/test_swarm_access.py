"""Swarm access control on real daemons: with a swarm secret (or an allowlist of peer ids), a daemon without it (not on it) cannot join, probe or submit.

Two members share a secret file; a stranger (no secret) and a friend (the secret) join through
them. Members list the friend and never the stranger, refuse the stranger's streams, and see
the friend's job but not the stranger's. ``peerd status`` says which kind of swarm it is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hivemind.p2p import P2P, PeerID

from peerd.control import ControlError
from peerd.errors import ErrorCode, ProtocolError
from peerd.jobs.records import normalized_spec
from peerd.jobs.spec import load_job_spec
from peerd.swarm.identity import Identity
from peerd.swarm.links import PROBE_PROTOCOL
from peerd.swarm.transport import Transport

pytestmark = pytest.mark.integration

SPEC = Path(__file__).resolve().parents[2] / "configs" / "jobs" / "gpt-tiny-demo.yaml"


def _peer_ids(view: dict[str, Any]) -> set[str]:
    return {p["peer_id"] for p in view.get("peers", [])}


def _jobs(peer: Any) -> set[str]:
    return {j["job_id"] for j in peer.control().call("jobs")}


def _submit(peer: Any) -> str | None:
    """Submit the demo job through ``peer``; its id, or None when the daemon itself says it could not publish."""
    try:
        return peer.control(timeout=60).call(
            "submit", spec=normalized_spec(load_job_spec(SPEC)), source=str(SPEC)
        )["job_id"]
    except ControlError as exc:
        assert exc.code == ErrorCode.PEER_UNAVAILABLE, exc
        return None


def _cancel(peer: Any, job_id: str) -> None:
    """Cancel ``job_id`` through ``peer``; a store no DHT node took in time (a loaded machine) is tried again."""
    for attempt in range(5):
        try:
            peer.control(timeout=60).call("cancel", job_id=job_id)
            return
        except ControlError as exc:
            if exc.code != ErrorCode.PEER_UNAVAILABLE or attempt == 4:
                raise
            time.sleep(2.0)


async def _probe_ping(maddrs: list[str], target: str) -> ErrorCode | None:
    """A peer of this process (not a member) opens a probe stream to ``target``; the refusal code, if any."""
    p2p = await P2P.create(initial_peers=maddrs)
    transport = Transport(p2p)
    try:
        conn = await transport.connect(PeerID.from_base58(target), PROBE_PROTOCOL)
        try:
            await conn.request({"kind": "probe.ping", "seq": 0}, timeout=10)
        except ProtocolError as exc:
            return exc.code
        finally:
            await conn.close()
        return None
    finally:
        await transport.close()
        await p2p.shutdown()


@pytest.mark.timeout(420)
def test_with_a_swarm_secret_only_holders_join_and_submit(
    local_swarm: Callable[..., Any], tmp_path: Path, wait_until: Callable[..., Any]
):
    secret = tmp_path / "swarm.secret"
    secret.write_text("a7f0c1e5-shared-by-the-members-only\n")
    swarm = local_swarm(2, swarm_secret_file=str(secret))
    m0, m1 = swarm.peers
    ids = {p.name: p.info.peer_id for p in swarm.peers}
    wait_until(lambda: ids["peer1"] in _peer_ids(m0.status()), 60, "the two members to list each other")

    stranger = swarm.add_peer("stranger", options={"swarm_secret_file": None})
    friend = swarm.add_peer("friend")
    ids.update(stranger=stranger.info.peer_id, friend=friend.info.peer_id)

    started = time.monotonic()
    wait_until(
        lambda: all(ids["friend"] in _peer_ids(m.status()) for m in (m0, m1)),
        60,
        "the members to list the friend (who holds the secret)",
    )
    joined_s = time.monotonic() - started
    time.sleep(3.0)  # two more refreshes of the stranger's record (refresh_interval 1.5 s)
    views = {m.name: m.status() for m in (m0, m1)}
    assert all(ids["stranger"] not in _peer_ids(v) for v in views.values()), views
    assert all(v["self"]["access"] == "secret" for v in views.values())
    assert stranger.status()["self"]["access"] == "open"
    assert ids["peer0"] not in _peer_ids(stranger.status())  # it cannot read the members' records either

    # streams: a peer without a record carrying the secret's proof is refused before any frame
    refused = asyncio.run(_probe_ping(list(m0.info.maddrs), ids["peer0"]))
    assert refused == ErrorCode.NOT_ALLOWED

    # submit: the friend's job reaches the members, the stranger's never does
    strangers_job = _submit(stranger)
    friends_job = _submit(friend)
    for _ in range(5):  # a member's store may not take a record of a peer it met seconds ago yet
        if friends_job is not None:
            break
        time.sleep(3.0)
        friends_job = _submit(friend)
    assert friends_job is not None
    wait_until(
        lambda: all(friends_job in _jobs(m) for m in (m0, m1)), 60, "the members to see the friend's job"
    )
    time.sleep(3.0)
    assert all(strangers_job not in _jobs(m) for m in (m0, m1)) if strangers_job else True
    _cancel(friend, friends_job)
    print(
        f"ACCESS friend joined in {joined_s:.1f} s; stranger listed by 0/2 members; stranger's probe "
        f"stream {refused.name}; stranger's job {'refused at submit' if strangers_job is None else 'seen by 0/2'}"
    )


@pytest.mark.timeout(420)
def test_with_an_allowlist_only_listed_peers_join_probe_and_submit(
    local_swarm: Callable[..., Any], tmp_path: Path, wait_until: Callable[..., Any]
):
    """Two listed members (their ids known before they start) and a stranger that joins through them."""
    keys = {name: tmp_path / f"{name}.key" for name in ("peer0", "friend", "stranger")}
    ids = {name: Identity.load_or_create(path).peer_id for name, path in keys.items()}
    listed = [ids["peer0"], ids["friend"]]
    swarm = local_swarm(1, identity=str(keys["peer0"]), allowed_peers=listed)
    m0 = swarm.peers[0]
    friend = swarm.add_peer("friend", options={"identity": str(keys["friend"])})
    stranger = swarm.add_peer("stranger", options={"identity": str(keys["stranger"]), "allowed_peers": []})
    assert {m0.info.peer_id, friend.info.peer_id, stranger.info.peer_id} == set(ids.values())

    wait_until(
        lambda: ids["friend"] in _peer_ids(m0.status()) and ids["peer0"] in _peer_ids(friend.status()),
        60,
        "the listed peers to list each other",
    )
    wait_until(  # the stranger's own records reach the members, which refuse them (and count it)
        lambda: m0.status()["refusals"]["dht_records"].get("NOT_ALLOWED", 0) > 0,
        60,
        "peer0 to refuse a record of the stranger",
    )
    views = {m.name: m.status() for m in (m0, friend)}
    assert all(ids["stranger"] not in _peer_ids(v) for v in views.values()), views
    assert all(v["self"]["access"] == "allowlist" for v in views.values())
    assert stranger.status()["self"]["access"] == "open"

    # streams: a peer id not on the list is refused before any frame, whatever records it has
    refused = asyncio.run(_probe_ping(list(m0.info.maddrs), ids["peer0"]))
    assert refused == ErrorCode.NOT_ALLOWED
    assert m0.status()["refusals"]["streams"].get("NOT_ALLOWED", 0) >= 1

    # submit: the friend's job reaches peer0, the stranger's never does
    strangers_job = _submit(stranger)
    friends_job = _submit(friend)
    for _ in range(5):
        if friends_job is not None:
            break
        time.sleep(3.0)
        friends_job = _submit(friend)
    assert friends_job is not None
    wait_until(lambda: friends_job in _jobs(m0), 60, "peer0 to see the friend's job")
    time.sleep(3.0)
    assert strangers_job is None or strangers_job not in _jobs(m0) | _jobs(friend)
    _cancel(friend, friends_job)
    print(
        f"ALLOWLIST stranger listed by 0/2 members; its probe stream {refused.name}; its job "
        f"{'refused at submit' if strangers_job is None else 'seen by 0/2'}; "
        f"peer0 refused {m0.status()['refusals']['dht_records']} DHT records"
    )


def test_an_allowlist_without_the_peers_own_id_is_refused_at_start(
    tmp_path: Path, peerd_cli: Callable[..., Any]
):
    other = Identity.generate().peer_id
    out = peerd_cli(
        "join",
        "--home",
        str(tmp_path / "home"),
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
        "--allowed-peers",
        other,
        timeout=60,
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "allowed_peers" in out.stderr and "own id" in out.stderr
