"""Link shaper: token-bucket pacing math on a fake clock, scenario mapping, and pacing of a real socket stream."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from peerd.errors import ConfigError
from peerd.sched.scenario import load_scenario
from peerd.swarm.shaper import LinkShaper, LinkSpec, TokenBucket, _Link

SCENARIOS = Path(__file__).resolve().parents[3] / "configs" / "scenarios"


def test_bucket_grants_burst_then_paces_at_rate():
    bucket = TokenBucket(rate_Bps=1000.0, burst_bytes=100.0, now=0.0)
    assert bucket.reserve(100, now=0.0) == 0.0  # the burst
    assert bucket.reserve(100, now=0.0) == pytest.approx(0.1)
    assert bucket.reserve(50, now=0.0) == pytest.approx(0.15)
    # debt carries over: a writer that arrives late still waits its turn
    assert bucket.reserve(100, now=0.2) == pytest.approx(0.25)


def test_bucket_refill_is_capped_at_burst():
    bucket = TokenBucket(rate_Bps=1000.0, burst_bytes=100.0, now=0.0)
    bucket.reserve(100, now=0.0)
    assert bucket.reserve(100, now=10.0) == 10.0  # refilled, but only to the burst size
    assert bucket.reserve(100, now=10.0) == pytest.approx(10.1)


def test_back_to_back_pieces_leave_at_exactly_the_link_rate():
    spec = LinkSpec(delay_s=0.05, bandwidth_bps=8_000_000)  # 1 MB/s
    link = _Link(spec, now=0.0)
    piece = spec.piece_bytes
    sends, visibles = zip(*(link.schedule(piece, now=0.0) for _ in range(250)), strict=True)
    # 250 pieces; the first goes out of the burst, the rest one piece-time apart
    assert sends[-1] == pytest.approx(249 * piece / 1e6)
    assert all(v - s == pytest.approx(0.05) for s, v in zip(sends, visibles, strict=True))
    # pipelined: the delay shifts every piece once, it does not add up per piece
    assert visibles[-1] - visibles[0] == pytest.approx(sends[-1] - sends[0])


def test_link_spec_validation():
    with pytest.raises(ConfigError):
        LinkSpec(delay_s=-1.0)
    with pytest.raises(ConfigError):
        LinkSpec(delay_s=float("nan"))
    with pytest.raises(ConfigError):
        LinkSpec(bandwidth_bps=0.0)
    assert LinkSpec(bandwidth_bps=20e6).piece_bytes == 10_000  # 4 ms of a 2.5 MB/s link
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


def test_real_stream_is_delayed_and_paced_without_dividing_throughput():
    """2 Mbit/s, 100 ms one-way over a loopback TCP socket: first byte after ~delay, total ~ delay + size/rate.

    Bounds are loose on the late side: a busy host wakes timers late, which only delays bytes.
    The exact pacing arithmetic is checked on a fake clock above.
    """
    spec = LinkSpec(delay_s=0.1, bandwidth_bps=2_000_000)
    total = 250_000  # 1.0 s at 250 kB/s, sent as 50 writes of 5 kB

    async def go():
        arrivals: list[tuple[float, int]] = []
        done = asyncio.Event()

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got = 0
            while got < total:
                data = await reader.read(65536)
                if not data:
                    break
                got += len(data)
                arrivals.append((time.monotonic(), got))
            done.set()
            writer.close()

        server = await asyncio.start_server(on_client, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        channel = LinkShaper.uniform(spec).channel("peer", writer)
        assert channel is not None
        started = time.monotonic()
        for _ in range(0, total, 5000):  # many small sends, like frames
            await channel.write(memoryview(bytes(5000)))
        returned = time.monotonic() - started
        await channel.flush()
        await asyncio.wait_for(done.wait(), 10)
        channel.close()
        writer.close()
        server.close()
        return started, returned, arrivals

    started, returned, arrivals = asyncio.run(go())
    first = arrivals[0][0] - started
    last = arrivals[-1][0] - started
    assert arrivals[-1][1] == total
    assert 0.095 <= first < 0.4  # nothing arrives before the one-way delay
    # the sender is paced (~1 s less the 50 ms look-ahead) and the last byte arrives one delay
    # after its slot: ~1.1 s, where a delay paid per write would take 1 + 50 x 0.1 = 6 s
    assert 0.85 <= returned < 1.5
    assert 1.0 <= last < 1.8
    rate = (arrivals[-1][1] - arrivals[0][1]) / (arrivals[-1][0] - arrivals[0][0])
    assert rate == pytest.approx(spec.rate_Bps, rel=0.2)
