"""Link shaper: token-bucket pacing math and a paced stream on a fake clock, scenario mapping, a real socket."""

from __future__ import annotations

import asyncio
import selectors
from pathlib import Path

import pytest

from peerd.errors import ConfigError
from peerd.sched.scenario import load_scenario
from peerd.swarm.shaper import LOOKAHEAD_S, LinkShaper, LinkSpec, _Link

SCENARIOS = Path(__file__).resolve().parents[3] / "configs" / "scenarios"


def test_a_link_serialises_pieces_first_come_first_served():
    link = _Link(LinkSpec(delay_s=0.5, bandwidth_bps=8000.0), now=0.0)  # 1000 B/s
    assert link.schedule(100, now=0.0) == pytest.approx((0.1, 0.6))  # no burst: 100 B take 0.1 s
    assert link.schedule(100, now=0.0) == pytest.approx((0.2, 0.7))  # behind the first
    assert link.schedule(50, now=0.05) == pytest.approx((0.25, 0.75))
    # an idle link does not bank capacity: a later piece starts when it is offered
    assert link.schedule(100, now=10.0) == pytest.approx((10.1, 10.6))
    unlimited = _Link(LinkSpec(delay_s=0.5), now=0.0)
    assert unlimited.schedule(10**9, now=3.0) == (3.0, 3.5)


def test_back_to_back_pieces_leave_at_exactly_the_link_rate():
    spec = LinkSpec(delay_s=0.05, bandwidth_bps=8_000_000)  # 1 MB/s
    link = _Link(spec, now=0.0)
    piece = spec.piece_bytes
    sents, visibles = zip(*(link.schedule(piece, now=0.0) for _ in range(250)), strict=True)
    # 250 pieces, one piece-time apart; the last byte leaves when the whole has crossed the link
    assert sents[-1] == pytest.approx(250 * piece / 1e6)
    assert all(v - s == pytest.approx(0.05) for s, v in zip(sents, visibles, strict=True))
    # pipelined: the delay shifts every piece once, it does not add up per piece
    assert visibles[-1] == pytest.approx(0.05 + 250 * piece / 1e6)


def test_link_spec_validation():
    with pytest.raises(ConfigError):
        LinkSpec(delay_s=-1.0)
    with pytest.raises(ConfigError):
        LinkSpec(delay_s=float("nan"))
    with pytest.raises(ConfigError):
        LinkSpec(bandwidth_bps=0.0)
    assert LinkSpec(bandwidth_bps=20e6).piece_bytes == 40_000  # 16 ms of a 2.5 MB/s link
    assert LinkSpec(bandwidth_bps=1e3).piece_bytes == 4096  # floor
    assert LinkSpec(bandwidth_bps=1e12).piece_bytes == 256 * 1024  # cap


def test_from_scenario_maps_peers_by_name():
    scenario = load_scenario(SCENARIOS / "loopback-4peers-regions.yaml")
    names = {"P1": "peer1", "P3": "peer3"}
    shaper = LinkShaper.from_scenario(scenario, "peer0", names.get)
    assert shaper.spec_for("P1") == LinkSpec(delay_s=0.001, bandwidth_bps=1e9)
    assert shaper.spec_for("P3") == LinkSpec(delay_s=0.1, bandwidth_bps=10e6)
    assert shaper.spec_for("P9") is None  # no name known yet: unshaped
    names["P9"] = "peer2"  # learned later (membership record): shaped from then on
    assert shaper.spec_for("P9") == LinkSpec(delay_s=0.04, bandwidth_bps=50e6)
    names["P8"] = "not-in-scenario"
    assert shaper.spec_for("P8") is None


def test_from_scenario_rejects_a_self_name_outside_the_scenario():
    scenario = load_scenario(SCENARIOS / "loopback-2peers-20mbit-40ms.yaml")
    with pytest.raises(ConfigError):
        LinkShaper.from_scenario(scenario, "peer7", lambda _p: None)


class _VirtualClock:
    now = 0.0


class _VirtualSelector(selectors.DefaultSelector):
    """Never blocks: when nothing is ready, the loop's clock jumps to the next timer instead."""

    def __init__(self, clock: _VirtualClock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None):
        events = super().select(0)
        if not events and timeout is None:
            raise RuntimeError("deadlock: no timer is pending and nothing can become ready")
        if not events and timeout:
            self._clock.now += timeout
        return events


class _VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time: ``asyncio.sleep`` and the shaper's clock advance together, instantly."""

    def __init__(self) -> None:
        self.clock = _VirtualClock()
        super().__init__(_VirtualSelector(self.clock))

    def time(self) -> float:
        return self.clock.now


class _RecordingWriter:
    """Stands in for the socket's StreamWriter: notes (virtual time, bytes) of every write."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.writes: list[tuple[float, bytes]] = []

    def write(self, data: bytes) -> None:
        self.writes.append((self._loop.time(), bytes(data)))

    async def drain(self) -> None:
        return None


def test_stream_is_delayed_once_and_paced_at_the_link_rate_on_virtual_time():
    """2 Mbit/s, 100 ms one-way: each piece reaches the socket when its last byte has crossed the link, exactly.

    A delay paid per write (instead of pipelined) would put the last byte at 1 + 50 x 0.1 = 6 s;
    a rate divided by the delay would stretch every gap. Both show up as exact mismatches here.
    """
    spec = LinkSpec(delay_s=0.1, bandwidth_bps=2_000_000)  # 250 kB/s
    total, write_bytes = 250_000, 5000  # 50 writes of 5 kB, like frames
    piece, rate = spec.piece_bytes, spec.rate_Bps
    loop = _VirtualTimeLoop()

    async def go():
        writer = _RecordingWriter(loop)
        channel = LinkShaper.uniform(spec, clock=loop.time).channel("peer", writer)
        assert channel is not None
        payload = bytes(range(256)) * (total // 256) + bytes(total % 256)
        for offset in range(0, total, write_bytes):
            await channel.write(memoryview(payload)[offset : offset + write_bytes])
        returned = loop.time()
        await channel.flush()
        channel.close()
        return payload, writer.writes, returned

    try:
        payload, writes, returned = loop.run_until_complete(go())
    finally:
        loop.close()
    assert b"".join(data for _, data in writes) == payload  # every byte, in order
    sent = 0
    for at, data in writes:
        sent += len(data)
        # each piece is handed over when its last byte has crossed the link: its share of the rate, then the delay
        assert at == pytest.approx(spec.delay_s + sent / rate, abs=1e-9)
    assert writes[-1][0] == pytest.approx(spec.delay_s + total / rate)
    assert max(len(data) for _, data in writes) <= piece
    # the writer returns once its last piece is reserved, up to the look-ahead before it leaves
    assert returned == pytest.approx(total / rate - LOOKAHEAD_S)


def test_real_socket_stream_arrives_whole_and_in_order():
    """The same channel over a loopback TCP socket (real drain, real timers): only what load cannot change."""
    spec = LinkSpec(delay_s=0.02, bandwidth_bps=8_000_000)
    payload = bytes(range(256)) * 200  # 51 200 bytes, ~50 ms at 1 MB/s

    async def go():
        received = bytearray()
        done = asyncio.Event()

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while len(received) < len(payload):
                data = await reader.read(65536)
                if not data:
                    break
                received.extend(data)
            done.set()
            writer.close()

        server = await asyncio.start_server(on_client, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        channel = LinkShaper.uniform(spec).channel("peer", writer)
        assert channel is not None
        for offset in range(0, len(payload), 3000):
            await channel.write(memoryview(payload)[offset : offset + 3000])
        await channel.flush()
        await asyncio.wait_for(done.wait(), 30)  # a hang guard only
        channel.close()
        writer.close()
        server.close()
        return bytes(received)

    assert asyncio.run(go()) == payload
