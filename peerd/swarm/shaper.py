"""Application-level link emulation: per-destination bandwidth and one-way delay on outgoing bytes.

Kernel shaping (tc netem) is not available on the machines peerd is tested on, so the
daemon paces its own outgoing stream bytes instead. Every destination peer has one
``_Link`` (a serialiser shared by all streams to that peer, like a real link); every
stream has a ``ShapedChannel`` that reserves link time for each piece it writes and hands
the piece to the socket only when its last byte would have arrived (serialised behind
the bytes before it, plus the delay). Pieces are queued, so the delay is pipelined: a
40 ms link still carries its full bandwidth, as a real one does. The math (``_Link``,
``LinkSpec``) is pure and clock-injected for unit tests.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from peerd.errors import ConfigError, ErrorCode, PeerUnavailable
from peerd.log import get_logger

logger = get_logger(__name__)

MIN_PIECE = 4 * 1024
MAX_PIECE = 256 * 1024
# pace in pieces of ~16 ms of link time: each piece is a wake-up and a write through p2pd (CPU the
# emulation takes from the jobs on a shared machine); a piece is handed over once its last byte
# would have arrived, so the size changes no message's arrival, only how smoothly a stream trickles
PIECE_SECONDS = 0.016
LOOKAHEAD_S = 0.05  # a writer may reserve link time up to this far ahead of now (absorbs scheduling jitter)
MIN_QUEUE_BYTES = (
    4 << 20
)  # a channel may queue this much (or 2x the bandwidth-delay product) before send blocks


@dataclass(frozen=True)
class LinkSpec:
    """How one directed link (this peer -> a destination) is emulated."""

    delay_s: float = 0.0
    """One-way delay added to every byte, seconds."""
    bandwidth_bps: float | None = None
    """Link rate in bits per second; None means not limited."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.delay_s) and self.delay_s >= 0):
            raise ConfigError("delay_s", f"must be a finite number >= 0, got {self.delay_s!r}")
        if self.bandwidth_bps is not None and not self.bandwidth_bps > 0:
            raise ConfigError("bandwidth_bps", f"must be > 0 or None (unlimited), got {self.bandwidth_bps!r}")

    @property
    def rate_Bps(self) -> float:
        return (
            math.inf
            if self.bandwidth_bps is None or math.isinf(self.bandwidth_bps)
            else self.bandwidth_bps / 8
        )

    @property
    def piece_bytes(self) -> int:
        """Pacing granularity for this link."""
        if math.isinf(self.rate_Bps):
            return MAX_PIECE
        return int(min(MAX_PIECE, max(MIN_PIECE, self.rate_Bps * PIECE_SECONDS)))


class _Link:
    """Shared state of one destination: its spec and when it has serialised every byte reserved so
    far (all streams to the peer share the link, first come first served)."""

    def __init__(self, spec: LinkSpec, now: float) -> None:
        self.spec = spec
        self._free_at = now

    def schedule(self, nbytes: int, now: float) -> tuple[float, float]:
        """``(sent_at, visible_at)`` for ``nbytes`` offered at ``now``: the piece's last byte leaves
        once the bytes before it have (no burst: a real link has none) and arrives the delay later;
        the piece is handed over whole then."""
        rate = self.spec.rate_Bps
        if math.isinf(rate):
            return now, now + self.spec.delay_s
        self._free_at = max(now, self._free_at) + nbytes / rate
        return self._free_at, self._free_at + self.spec.delay_s


class ShapedChannel:
    """Paces one stream's outgoing bytes through its destination's link; a pump task writes them when due."""

    def __init__(self, link: _Link, writer: asyncio.StreamWriter, clock: Callable[[], float]) -> None:
        self._link = link
        self._writer = writer
        self._clock = clock
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._queued_bytes = 0
        rate = link.spec.rate_Bps
        bdp = 0 if math.isinf(rate) else rate * (link.spec.delay_s + LOOKAHEAD_S)
        self._max_queued = max(MIN_QUEUE_BYTES, int(2 * bdp))
        self._wake = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._error: BaseException | None = None
        self._pump_task = asyncio.create_task(self._pump(), name="peerd-shaper-pump")

    async def write(self, data: memoryview) -> None:
        """Offer ``data`` to the link: returns once it is paced and queued (copied), like a socket send buffer."""
        piece = self._link.spec.piece_bytes
        for offset in range(0, data.nbytes, piece):
            self._raise_if_failed()
            chunk = data[offset : offset + piece]
            now = self._clock()
            sent_at, visible_at = self._link.schedule(chunk.nbytes, now)
            if sent_at - now > LOOKAHEAD_S:
                # Sleep only to stay within the look-ahead: the reservation, not the wake-up, fixes
                # when the piece leaves, so a late wake-up (a busy host) costs no link capacity.
                await asyncio.sleep(sent_at - now - LOOKAHEAD_S)
            while self._queued_bytes >= self._max_queued:
                self._space.clear()
                await self._space.wait()
                self._raise_if_failed()
            self._queue.append((visible_at, chunk.tobytes()))  # copy: the caller may reuse its buffer
            self._queued_bytes += chunk.nbytes
            self._wake.set()

    async def flush(self) -> None:
        """Wait until every queued byte has been handed to the socket."""
        while self._queue and self._error is None:
            self._space.clear()
            await self._space.wait()
        self._raise_if_failed()

    def close(self) -> None:
        self._pump_task.cancel()
        self._queue.clear()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PeerUnavailable(f"shaped stream broke: {self._error}", code=ErrorCode.PEER_UNAVAILABLE)

    async def _pump(self) -> None:
        try:
            while True:
                while not self._queue:
                    self._wake.clear()
                    await self._wake.wait()
                due = self._queue[0][0] - self._clock()
                if due > 0:
                    await asyncio.sleep(due)
                now = self._clock()
                while self._queue and self._queue[0][0] <= now:
                    _, data = self._queue.popleft()
                    self._writer.write(data)
                    self._queued_bytes -= len(data)
                await self._writer.drain()
                self._space.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream broke: surface it to the writer side
            self._error = exc
            self._space.set()


class ScenarioLike(Protocol):
    """What the shaper needs from ``peerd.sched.scenario.Scenario``."""

    @property
    def device_ids(self) -> list[str]: ...

    def delay_s(self, src_id: str, dst_id: str) -> float: ...

    def bandwidth_bps(self, src_id: str, dst_id: str) -> float: ...


class LinkShaper:
    """Emulates the links from this peer to every destination; unknown destinations pass unshaped."""

    def __init__(
        self,
        resolve: Callable[[Hashable], LinkSpec | None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._resolve = resolve
        self._clock = clock
        self._links: dict[Hashable, _Link | None] = {}  # None: resolved, and not shaped
        self._unknown_logged: set[Hashable] = set()

    @classmethod
    def uniform(cls, spec: LinkSpec, **kwargs) -> LinkShaper:
        """The same emulated link to every destination (tests, benchmarks)."""
        return cls(lambda _peer: spec, **kwargs)

    @classmethod
    def from_scenario(
        cls,
        scenario: ScenarioLike,
        self_name: str,
        name_of_peer: Callable[[Hashable], str | None],
        **kwargs,
    ) -> LinkShaper:
        """Shape links as the scenario says between device ``self_name`` and the device named like each peer.

        Peers map to scenario devices by name (the daemon's ``--name``); ``name_of_peer`` may
        learn names later (from membership records), so unknown peers are asked again on the
        next stream.
        """
        ids = set(scenario.device_ids)
        if self_name not in ids:
            raise ConfigError(
                "name", f"{self_name!r} is not a device of the scenario (devices: {sorted(ids)})"
            )

        def resolve(peer: Hashable) -> LinkSpec | None:
            name = name_of_peer(peer)
            if name is None or name not in ids:
                return None
            try:
                bandwidth = scenario.bandwidth_bps(self_name, name)
                delay = scenario.delay_s(self_name, name)
            except ConfigError as exc:  # the scenario leaves this pair unmeasured
                logger.warning("link shaping: %s", exc)
                return None
            return LinkSpec(
                delay_s=float(delay), bandwidth_bps=None if math.isinf(bandwidth) else float(bandwidth)
            )

        return cls(resolve, **kwargs)

    def spec_for(self, peer: Hashable) -> LinkSpec | None:
        link = self._link(peer)
        return None if link is None else link.spec

    def channel(self, peer: Hashable, writer: asyncio.StreamWriter) -> ShapedChannel | None:
        """A pacing channel for a new stream to ``peer``, or None when that link is not shaped."""
        link = self._link(peer)
        if link is None:
            return None
        return ShapedChannel(link, writer, self._clock)

    def _link(self, peer: Hashable) -> _Link | None:
        if peer in self._links:
            return self._links[peer]
        spec = self._resolve(peer)
        if spec is None:
            if peer not in self._unknown_logged:
                self._unknown_logged.add(peer)
                logger.info("link shaping: no scenario device for peer %s; its traffic is not shaped", peer)
            return None
        if spec.delay_s == 0 and spec.bandwidth_bps is None:
            self._links[peer] = None
            return None
        link = self._links[peer] = _Link(spec, self._clock())
        logger.info(
            "link shaping to %s: %.1f ms one-way, %s",
            peer,
            spec.delay_s * 1e3,
            "unlimited" if spec.bandwidth_bps is None else f"{spec.bandwidth_bps / 1e6:.3g} Mbit/s",
        )
        return link
