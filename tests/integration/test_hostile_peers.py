"""Attacks of a hostile peer against a real peerd daemon on loopback (issue 15), with the figures printed.

The victim is one ``peerd join`` process; the attackers are p2pd daemons of this test process
that connect to it directly (they need no DHT record to open streams). Each test prints one
``ATTACK {json}`` line with what it measured (run with ``-s`` to see it).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hivemind.p2p import P2P, PeerID
from prometheus_client.parser import text_string_to_metric_families

from peerd.errors import ErrorCode, PeerdError, PeerUnavailable
from peerd.swarm.framing import encode_frame, read_frame
from peerd.swarm.links import PROBE_PROTOCOL, LinkProber, ProbeConfig
from peerd.swarm.records import LinkStatus
from peerd.swarm.transport import Connection, Transport

pytestmark = pytest.mark.integration

BAN_S = 4.0  # the victim's first ban (the daemon's ban_s); the second lasts twice as long
QUICK = ProbeConfig(
    pings=2, bulk_seconds=0.2, bulk_bytes=1 << 20, connect_timeout_s=5.0, probe_timeout_s=10.0
)


def report(name: str, **figures: Any) -> None:
    print(f"ATTACK {json.dumps({'attack': name, **figures}, sort_keys=True)}")


class Attackers:
    """p2pd daemons of this process, each a distinct peer identity, connected to the victim daemon."""

    def __init__(self, victim_maddrs: list[str], victim_id: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.maddrs = victim_maddrs
        self.victim = PeerID.from_base58(victim_id)
        self.p2ps: list[P2P] = []
        self.transports: list[Transport] = []

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    async def new(self) -> Transport:
        p2p = await P2P.create(initial_peers=self.maddrs)
        self.p2ps.append(p2p)
        transport = Transport(p2p)
        self.transports.append(transport)
        return transport

    async def raw(self, transport: Transport, protocol: str = PROBE_PROTOCOL):
        """A raw (reader, writer) stream to the victim: the attacker writes whatever bytes it likes."""
        _info, reader, writer = await transport.p2p.call_binary_stream_handler(self.victim, protocol)
        return reader, writer

    async def close(self) -> None:
        for transport in self.transports:
            await transport.close()
        for p2p in self.p2ps:
            await p2p.shutdown()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def victim(module_local_swarm: Callable[..., Any]) -> Any:
    swarm = module_local_swarm(1, ban_s=BAN_S, metrics_port=_free_port())
    return swarm.peers[0]


def refusals(victim: Any) -> dict[str, Any]:
    """The victim's ``peerd status`` counters of what it refused (peerd.swarm.rejections)."""
    return victim.status()["refusals"]


def scraped_refusals(victim: Any) -> dict[tuple[str, str], float]:
    """``peerd_refusals_total`` (and ``peerd_bans_total`` as ("bans", "")) from the victim's /metrics."""
    url = f"http://127.0.0.1:{victim.options['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "peerd_refusals_total":
                out[(s.labels["layer"], s.labels["code"])] = s.value
            elif s.name == "peerd_bans_total":
                out[("bans", "")] = s.value
    return out


def moved(before: dict[str, Any], after: dict[str, Any], layer: str, code: str) -> int:
    return after[layer].get(code, 0) - before[layer].get(code, 0)


@pytest.fixture
def attackers(victim: Any) -> Iterator[Attackers]:
    a = Attackers(list(victim.info.maddrs), victim.info.peer_id)
    try:
        yield a
    finally:
        a.run(a.close(), timeout=60)
        a.loop.close()


def test_probe_download_answers_are_bounded_by_the_per_peer_byte_budget(attackers: Attackers, victim: Any):
    """840 bytes of ``probe.down_request`` (10 x 32 MiB asked) once made a daemon send 320 MiB."""
    budget = ProbeConfig()

    async def go() -> dict[str, Any]:
        me = await attackers.new()
        conn = await me.connect(attackers.victim, PROBE_PROTOCOL)
        ask = {"kind": "probe.down_request", "bytes": 32 << 20, "seconds": 5.0, "frame_bytes": 256 << 10}
        refused = None
        started = time.monotonic()
        for _ in range(10):
            try:
                await conn.send(ask)
                while True:
                    header, _ = await conn.recv(timeout=20)
                    if header.get("last") is True:
                        break
            except PeerdError as exc:
                refused = exc
                break
        elapsed = time.monotonic() - started
        await conn.close()
        return {
            "sent": conn.bytes_sent,
            "received": conn.bytes_received,
            "elapsed": elapsed,
            "refused": None if refused is None else refused.code.name,
        }

    before = refusals(victim)
    got = attackers.run(go())
    allowed = budget.answer_burst_bytes + budget.answer_rate_Bps * got["elapsed"] + (1 << 20)
    report(
        "probe-amplification",
        request_bytes=got["sent"],
        answer_bytes=got["received"],
        amplification=round(got["received"] / got["sent"]),
        elapsed_s=round(got["elapsed"], 2),
        refused=got["refused"],
        budget_bytes=int(allowed),
    )
    assert got["received"] <= allowed
    assert got["refused"] == ErrorCode.RATE_LIMITED.name  # told why, with a code, not silently cut
    assert moved(before, refusals(victim), "handlers", "RATE_LIMITED") == 1  # and counted
    # the budget refills: after a pause a legitimate probe from the same peer is answered again
    attackers.run(asyncio.sleep(2.0))
    m = attackers.run(LinkProber(attackers.transports[0], QUICK).probe(attackers.victim))
    assert m.status == LinkStatus.OK, m


async def _trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, every: float) -> float:
    """Send a valid ping one byte every ``every`` seconds until the victim closes; return how long it held on."""
    frame = encode_frame({"kind": "probe.ping", "seq": 0})
    started = time.monotonic()
    with pytest.raises((ConnectionError, OSError, asyncio.IncompleteReadError, PeerdError, TimeoutError)):
        for i in range(10_000):
            writer.write(frame[i % len(frame) : i % len(frame) + 1])
            await writer.drain()
            try:
                async with asyncio.timeout(every):
                    data = await reader.read(1 << 16)
                if not data:
                    raise ConnectionError("closed by the victim")
            except TimeoutError:
                pass
    return time.monotonic() - started


async def _ping_steadily(conn: Connection, every: float) -> tuple[float, str]:
    """Ping every ``every`` s (always within the idle timeout) until refused; return (seconds held, code)."""
    started = time.monotonic()
    try:
        for seq in range(10_000):
            await conn.request({"kind": "probe.ping", "seq": seq}, timeout=30)
            await asyncio.sleep(every)
    except PeerdError as exc:
        return time.monotonic() - started, exc.code.name
    finally:
        await conn.close()
    return time.monotonic() - started, "never refused"


def test_slow_sessions_lose_their_slot_and_never_lock_legitimate_probers_out(
    attackers: Attackers, victim: Any
):
    """Two sessions trickling one byte every 5 s once held both probe slots: every other prober got BUSY.

    Now a trickling session is closed at the idle timeout (its frame never arrives whole) and a
    session that pings steadily forever is closed at the session timeout; while both are held,
    honest probes from a third peer are answered.
    """
    cfg = ProbeConfig()

    async def go() -> dict[str, Any]:
        trickler, pinger, honest = [await attackers.new() for _ in range(3)]
        reader, writer = await attackers.raw(trickler)
        trickling = asyncio.create_task(_trickle(reader, writer, every=5.0))
        pinging = asyncio.create_task(
            _ping_steadily(await pinger.connect(attackers.victim, PROBE_PROTOCOL), every=2.0)
        )
        await asyncio.sleep(1.0)  # both slow sessions are in place
        probes = [await LinkProber(honest, QUICK).probe(attackers.victim) for _ in range(3)]
        held = await asyncio.wait_for(trickling, cfg.session_timeout_s + 30)
        pinged, code = await asyncio.wait_for(pinging, cfg.session_timeout_s + 30)
        return {"probes": probes, "trickle_held": held, "ping_held": pinged, "ping_code": code}

    got = attackers.run(go(), timeout=cfg.session_timeout_s + 90)
    statuses = [m.status.value for m in got["probes"]]
    report(
        "probe-lockout",
        honest_probes=statuses,
        trickle_held_s=round(got["trickle_held"], 1),
        steady_pinger_held_s=round(got["ping_held"], 1),
        steady_pinger_refused=got["ping_code"],
        idle_timeout_s=cfg.idle_timeout_s,
        session_timeout_s=cfg.session_timeout_s,
    )
    assert statuses == ["ok"] * 3
    assert got["trickle_held"] <= cfg.idle_timeout_s + 5  # its frame never arrived whole
    assert cfg.session_timeout_s - 3 <= got["ping_held"] <= cfg.session_timeout_s + 5
    assert got["ping_code"] == ErrorCode.TIMEOUT.name


def test_one_peer_cannot_hold_every_probe_slot(attackers: Attackers, victim: Any):
    cfg = ProbeConfig()

    async def go() -> dict[str, Any]:
        greedy = await attackers.new()
        held, refused = [], []
        for _ in range(cfg.max_sessions):
            conn = await greedy.connect(attackers.victim, PROBE_PROTOCOL)
            try:
                await conn.request({"kind": "probe.ping", "seq": 0}, timeout=10)
                held.append(conn)
            except PeerUnavailable as exc:
                refused.append(exc.code.name)
                await conn.close()
        honest = await attackers.new()
        m = await LinkProber(honest, QUICK).probe(attackers.victim)
        for conn in held:
            await conn.close()
        return {"held": len(held), "refused": refused, "honest": m.status.value}

    got = attackers.run(go())
    report("probe-slots-one-peer", **got)
    assert got["held"] == cfg.max_sessions_per_peer
    assert got["refused"] == [ErrorCode.RATE_LIMITED.name] * (cfg.max_sessions - cfg.max_sessions_per_peer)
    assert got["honest"] == "ok"


async def _garbage(attackers: Attackers, transport: Transport) -> str:
    """One stream of bytes that are not a frame; return the code of the victim's answer."""
    reader, writer = await attackers.raw(transport)
    writer.write(b"XX" + bytes(14))  # bad magic
    await writer.drain()
    try:
        header, _, _ = await read_frame(reader, timeout=10)
        return ErrorCode(header["code"]).name
    finally:
        writer.close()


def test_a_peer_that_keeps_sending_garbage_is_banned_until_the_ban_expires(attackers: Attackers, victim: Any):
    async def go() -> dict[str, Any]:
        bad, honest = await attackers.new(), await attackers.new()
        bad_id = bad.peer_id.to_base58()
        answers = [await _garbage(attackers, bad) for _ in range(4)]
        banned_view = victim.status()["self"]["banned"]
        while_banned = await LinkProber(bad, QUICK).probe(attackers.victim)
        others = await LinkProber(honest, QUICK).probe(attackers.victim)
        waited = time.monotonic()
        while bad_id in victim.status()["self"]["banned"]:
            await asyncio.sleep(0.2)
        waited = time.monotonic() - waited
        after = await LinkProber(bad, QUICK).probe(attackers.victim)
        again = [await _garbage(attackers, bad) for _ in range(3)]
        second_ban = victim.status()["self"]["banned"].get(bad_id)
        return {
            "answers": answers,
            "banned_s": banned_view.get(bad_id),
            "while_banned": while_banned.status.value,
            "others": others.status.value,
            "waited_s": waited,
            "after": after.status.value,
            "again": again,
            "second_ban_s": second_ban,
        }

    before = refusals(victim)
    got = attackers.run(go())
    after = refusals(victim)
    scraped = scraped_refusals(victim)
    report("garbage-ban", **{k: (round(v, 1) if isinstance(v, float) else v) for k, v in got.items()})
    assert got["answers"] == ["MALFORMED"] * 3 + ["BANNED"]  # 3 garbage streams ban (4 points each, 10 ban)
    assert got["banned_s"] is not None and 0 < got["banned_s"] <= BAN_S
    assert got["while_banned"] == "busy"  # refused with BANNED: the prober keeps its last numbers
    assert got["others"] == "ok"  # nobody else is affected
    assert got["waited_s"] <= BAN_S + 2 and got["after"] == "ok"  # the ban expires by itself
    assert got["again"] == ["MALFORMED"] * 3
    assert got["second_ban_s"] is not None and BAN_S < got["second_ban_s"] <= 2 * BAN_S  # it doubled
    # counted in peerd status and /metrics: 6 garbage streams, >= 2 refused while banned, 2 bans
    assert moved(before, after, "handlers", "MALFORMED") == 6
    assert moved(before, after, "streams", "BANNED") >= 2
    assert after["bans"] - before["bans"] == 2
    assert scraped[("handlers", "MALFORMED")] >= after["handlers"]["MALFORMED"]
    assert (
        scraped[("streams", "BANNED")] >= after["streams"]["BANNED"]
        and scraped[("bans", "")] >= after["bans"]
    )


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class _RssSampler:
    """Samples a process's resident memory every 50 ms in a thread (the event loop is busy attacking)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = _rss_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _rss_bytes(self.pid))

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


RSS_BOUND = 64 << 20  # the daemon's resident memory may grow at most this much during and after the attack


def test_resident_memory_stays_bounded_during_and_after_an_oversized_frame_attack(
    attackers: Attackers, victim: Any
):
    """Frames that declare 1 GiB payloads once took a daemon from 550 MB to 2.6 GB in 3 s (5 GB after 4 bursts).

    Four bursts of 8 streams, one per identity: each sends a 58-byte frame head declaring a 1 GiB
    payload and then pushes 4 MiB of payload bytes after it, as fast as the victim takes them.
    """
    head = encode_frame({"kind": "probe.up", "seq": 0, "last": False, "pad": "x" * 20})[:58]
    head = head[:8] + (1 << 30).to_bytes(8, "big") + head[16:]  # payload_len: 1 GiB
    junk = bytes(4 << 20)

    async def one(transport: Transport) -> str:
        try:
            reader, writer = await attackers.raw(transport)
        except Exception as exc:  # a refused stream is an answer too
            return type(exc).__name__
        try:
            writer.write(head)
            for offset in range(0, len(junk), 256 << 10):
                writer.write(junk[offset : offset + (256 << 10)])
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        try:
            header, _, _ = await read_frame(reader, timeout=10)
            return ErrorCode(header["code"]).name
        except PeerdError as exc:
            return f"closed:{exc.code.name}"
        finally:
            writer.close()

    async def go() -> dict[str, Any]:
        identities = [await attackers.new() for _ in range(8)]
        await asyncio.sleep(1.0)
        before = _rss_bytes(victim.pid)
        answers: dict[str, int] = {}
        with _RssSampler(victim.pid) as sampler:
            for _burst in range(4):
                results = await asyncio.gather(*(one(identity) for identity in identities))
                for r in results:
                    answers[r] = answers.get(r, 0) + 1
            await asyncio.sleep(3.0)  # after: the streams are gone
            after = _rss_bytes(victim.pid)
        return {"before": before, "peak": sampler.peak, "after": after, "answers": answers}

    got = attackers.run(go(), timeout=180)
    mb = 1 << 20
    report(
        "oversized-frames-rss",
        rss_before_mb=round(got["before"] / mb, 1),
        rss_peak_mb=round(got["peak"] / mb, 1),
        rss_after_mb=round(got["after"] / mb, 1),
        bound_mb=RSS_BOUND // mb,
        declared_gib=4 * 8,
        answers=got["answers"],
    )
    assert got["peak"] - got["before"] <= RSS_BOUND
    assert got["after"] - got["before"] <= RSS_BOUND
    # refused on the prefix, before any payload byte (BUSY: all 4 probe slots taken; BANNED: after
    # 3 garbage streams); never an INTERNAL error or a hang
    assert got["answers"].get("OVERSIZED", 0) >= 8
    refusals = {"OVERSIZED", "BANNED", "BUSY", "RATE_LIMITED", "closed:PEER_UNAVAILABLE", "closed:TRUNCATED"}
    assert set(got["answers"]) <= refusals
    assert victim.alive and victim.status()["self"]["state"] == "online"
