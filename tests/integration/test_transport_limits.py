"""Per-peer stream limits of every served protocol, over real p2pd daemons: slots, idle and session timeouts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from hivemind.p2p import P2P

from peerd.errors import ErrorCode, PeerUnavailable
from peerd.swarm.framing import StreamClosed
from peerd.swarm.limits import OPEN_STREAM_LIMITS, StreamLimits
from peerd.swarm.transport import Connection, Transport

pytestmark = pytest.mark.integration


class Trio:
    """Server A and two clients B and C (distinct peer ids), each with a Transport, on one loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.p2ps: list[P2P] = []

    def run(self, coro, timeout: float = 60.0):
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    async def start(self) -> None:
        a = await P2P.create()
        maddrs = await a.get_visible_maddrs()
        self.p2ps = [a, await P2P.create(initial_peers=maddrs), await P2P.create(initial_peers=maddrs)]
        self.server, self.b, self.c = (Transport(p) for p in self.p2ps)
        self.a_id = a.peer_id
        self.held = asyncio.Event()

        async def hold(conn: Connection) -> None:  # answers pings; waits for the remote as long as allowed
            while True:
                try:
                    header, _ = await conn.recv(timeout=None)
                except StreamClosed:
                    return
                await conn.send({"kind": "pong", "seq": header.get("seq")})

        self.limits = StreamLimits(max_per_peer=2, max_total=3, idle_timeout_s=1.5, session_timeout_s=4.0)
        await self.server.serve("test/limited/1", hold, streams=self.limits)
        await self.server.serve("test/open/1", hold)
        await self.server.serve("test/allowed/1", hold, allowed=lambda peer: True)

    async def stop(self) -> None:
        for t in (self.server, self.b, self.c):
            await t.close()
        for p in self.p2ps:
            await p.shutdown()


@pytest.fixture(scope="module")
def trio() -> Iterator[Trio]:
    t = Trio()
    t.run(t.start())
    try:
        yield t
    finally:
        t.run(t.stop())
        t.loop.close()


async def _open(client: Transport, trio: Trio, protocol: str = "test/limited/1") -> Connection:
    conn = await client.connect(trio.a_id, protocol)
    await conn.request({"kind": "ping", "seq": 0}, timeout=10)  # the server has granted a slot
    return conn


def test_a_peer_gets_its_share_of_streams_and_everyone_the_total(trio: Trio):
    async def go():
        mine = [await _open(trio.b, trio) for _ in range(2)]
        third = await trio.b.connect(trio.a_id, "test/limited/1")
        with pytest.raises(PeerUnavailable) as own_share:
            await third.request({"kind": "ping", "seq": 0}, timeout=10)
        other = await _open(trio.c, trio)  # another peer still gets in: slot 3 of 3
        fourth = await trio.c.connect(trio.a_id, "test/limited/1")
        with pytest.raises(PeerUnavailable) as everyone:
            await fourth.request({"kind": "ping", "seq": 0}, timeout=10)
        slots = trio.server.slots("test/limited/1")
        held = (slots.held(trio.b.peer_id), slots.held(trio.c.peer_id), slots.total)
        for conn in (*mine, third, other, fourth):
            await conn.close()
        for _ in range(200):  # the server sees the closes and frees the slots
            if slots.total == 0:
                break
            await asyncio.sleep(0.05)
        again = await _open(trio.b, trio)
        await again.close()
        return own_share.value.code, everyone.value.code, held, dict(trio.server.refusals)

    own, everyone, held, refusals = trio.run(go())
    assert own == ErrorCode.RATE_LIMITED and everyone == ErrorCode.BUSY
    assert held == (2, 1, 3)
    assert refusals.get(ErrorCode.RATE_LIMITED, 0) >= 1 and refusals.get(ErrorCode.BUSY, 0) >= 1


def test_a_silent_stream_ends_at_the_idle_timeout_and_a_busy_one_at_the_session_timeout(trio: Trio):
    async def go():
        silent = await _open(trio.b, trio)
        started = time.monotonic()
        with pytest.raises(PeerUnavailable):  # the server gives up on it and closes: a clean end here
            await silent.recv(timeout=20)
        silent_s = time.monotonic() - started
        await silent.close()

        busy = await _open(trio.b, trio)
        started = time.monotonic()
        with pytest.raises(PeerUnavailable) as ended:
            for seq in range(1, 10_000):
                await busy.request({"kind": "ping", "seq": seq}, timeout=10)
                await asyncio.sleep(0.5)  # always well within the idle timeout
        busy_s = time.monotonic() - started
        await busy.close()
        return silent_s, busy_s, ended.value.code

    silent_s, busy_s, code = trio.run(go())
    assert 1.0 <= silent_s <= 1.5 + 3.0  # idle timeout + the server's linger
    assert 3.0 <= busy_s <= 4.0 + 3.0 and code == ErrorCode.TIMEOUT


def test_open_protocols_get_the_stricter_defaults(trio: Trio):
    async def go():
        held = [await _open(trio.b, trio, "test/open/1") for _ in range(OPEN_STREAM_LIMITS.max_per_peer)]
        extra = await trio.b.connect(trio.a_id, "test/open/1")
        with pytest.raises(PeerUnavailable) as refused:
            await extra.request({"kind": "ping", "seq": 0}, timeout=10)
        allowed = [
            await _open(trio.b, trio, "test/allowed/1") for _ in range(OPEN_STREAM_LIMITS.max_per_peer + 1)
        ]
        for conn in (*held, extra, *allowed):
            await conn.close()
        return refused.value.code

    assert trio.run(go()) == ErrorCode.RATE_LIMITED
