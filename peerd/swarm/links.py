"""Link probes over the real transport path: RTT (fastest ping-pong) and bandwidth (timed bulk, both directions).

One probe session is one ``peerd/probe/1`` stream (messages in protocols/probes.md):
``probe.ping`` x N, then an upload (``probe.up`` frames; the responder answers with
``probe.up_result``: the bytes it timed and how long they took on its clock), then a download
(``probe.down_request``; the responder streams ``probe.down`` frames). Bandwidth is timed at
the receiver from the end of the first bulk frame to the end of the last, counting wire
bytes of the frames in between, so the one-way delay and the start-up burst drop out.
Each direction is bounded by a byte and a time budget; the whole session by a deadline.
The responder serves each peer fairly: one session per peer at a time, a few in total, each
within an idle and a total timeout, and every byte it answers with is charged to the
peer's token bucket (a small request cannot make it send without bound).
``LinkProber.refresh`` probes a bounded number of peers per call, stalest first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from msgspec import Meta

from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerUnavailable, ProtocolError
from peerd.log import get_logger
from peerd.swarm.framing import FrameLimits, StreamClosed
from peerd.swarm.limits import BudgetConfig, ByteBudget, StreamLimits
from peerd.swarm.records import LinkMeasurement, LinkStatus
from peerd.swarm.transport import Connection, Transport
from peerd.tasks import cancel_and_wait
from peerd.wire import WireStruct, convert, to_builtin

logger = get_logger(__name__)

PROCEED_CHECK_S = 0.25  # how often a running probe asks whether it may go on (``LinkProber.refresh``)

PROBE_PROTOCOL = "peerd/probe/1"
PING, PONG = "probe.ping", "probe.pong"
UP, UP_RESULT = "probe.up", "probe.up_result"
DOWN_REQUEST, DOWN = "probe.down_request", "probe.down"


@dataclass(frozen=True)
class ProbeConfig:
    """Budgets of the prober (one refresh) and limits of the responder."""

    pings: int = 7
    """Round trips per probe (after one warm-up); the RTT is the fastest: the path's delay and the
    least host time. The slower ones add queueing behind whatever else the two hosts and the link
    were busy with, which says nothing about the link and would make the plans follow the load at
    probe time (``peerd bench wan``: with 8 daemons training on 2 cores the medians' one-way delays
    were 2x the shaped delays in the median, up to 45x)."""
    bulk_bytes: int = 8 << 20
    """Most bytes sent per direction per probe."""
    bulk_seconds: float = 1.0
    """Most seconds spent sending per direction per probe."""
    frame_bytes: int = 32 << 10
    """Payload per bulk frame (the timing resolution is one frame)."""
    connect_timeout_s: float = 5.0
    """Deadline for opening the probe stream."""
    probe_timeout_s: float = 15.0
    """Deadline for one whole probe session; after it the peer is marked TIMEOUT, not waited on."""
    peers_per_refresh: int = 4
    """Most peers probed per ``refresh`` call (stalest first)."""
    busy_backoff_s: float = 60.0
    """Prober: a peer that answered BUSY while this one holds good figures for its link is not
    probed again for this long (a peer working for a job refuses such probes for as long as the job
    runs; a retry every round would only cost it a stream each time)."""
    history: int = 3
    """A link's published figures are the medians of its last this many successful probes: one
    probe that ran while the host was busy (a round trip of 10 ms where the others took 0.5) does
    not stand for the link until the next."""
    max_sessions: int = 4
    """Responder: concurrent probe sessions served; more are refused with BUSY."""
    max_sessions_per_peer: int = 1
    """Responder: concurrent probe sessions of one peer; more are refused with RATE_LIMITED
    (so one peer cannot hold every slot)."""
    idle_timeout_s: float = 5.0
    """Responder: a session whose next frame does not arrive whole within this long is closed
    (a prober sends its frames back to back; a trickle of bytes does not keep a slot)."""
    session_timeout_s: float = 20.0
    """Responder: a session open longer than this is closed with TIMEOUT, however busy (a whole
    probe takes about 2 x bulk_seconds + a few round trips; the prober gives up at 15 s)."""
    answer_burst_bytes: int = 16 << 20
    """Responder: bytes one peer may get in answers at once (two default downloads)."""
    answer_rate_Bps: float = 512 << 10
    """Responder: bytes per second one peer's answer budget refills (4 Mbit/s)."""
    answer_total_burst_bytes: int = 64 << 20
    """Responder: bytes all peers together may get at once."""
    answer_total_rate_Bps: float = 4 << 20
    """Responder: bytes per second of the shared budget of all peers (32 Mbit/s of this uplink)."""
    max_bulk_bytes: int = 32 << 20
    """Responder: cap on the bytes one download request may ask for."""
    max_bulk_seconds: float = 5.0
    """Responder: cap on the seconds one download request may ask for."""
    max_frame_bytes: int = 256 << 10
    """Responder: cap on the frame size a download request may ask for."""

    def __post_init__(self) -> None:
        for name in (
            "pings",
            "bulk_bytes",
            "frame_bytes",
            "peers_per_refresh",
            "history",
            "max_sessions",
            "max_sessions_per_peer",
            "answer_burst_bytes",
            "answer_total_burst_bytes",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)!r}")
        for name in (
            "bulk_seconds",
            "connect_timeout_s",
            "probe_timeout_s",
            "idle_timeout_s",
            "session_timeout_s",
            "max_bulk_seconds",
            "answer_rate_Bps",
            "answer_total_rate_Bps",
            "busy_backoff_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)!r}")
        if self.max_sessions_per_peer > self.max_sessions:
            raise ConfigError("max_sessions_per_peer", f"must be <= max_sessions ({self.max_sessions})")
        if self.frame_bytes > self.max_frame_bytes:
            raise ConfigError("frame_bytes", f"must be <= max_frame_bytes ({self.max_frame_bytes})")

    @property
    def stream_limits(self) -> StreamLimits:
        """What the responder's transport grants probe streams."""
        return StreamLimits(
            max_per_peer=self.max_sessions_per_peer,
            max_total=self.max_sessions,
            idle_timeout_s=self.idle_timeout_s,
            session_timeout_s=self.session_timeout_s,
        )

    @property
    def frame_limits(self) -> FrameLimits:
        """Probe frames are small: a bulk frame is at most ``max_frame_bytes`` (bigger ones: OVERSIZED)."""
        return FrameLimits(max_header=4096, max_payload=self.max_frame_bytes)

    @property
    def answer_budget(self) -> BudgetConfig:
        return BudgetConfig(
            rate_Bps=self.answer_rate_Bps,
            burst_bytes=self.answer_burst_bytes,
            total_rate_Bps=self.answer_total_rate_Bps,
            total_burst_bytes=self.answer_total_burst_bytes,
        )


def _expect(header: dict[str, Any], kind: str) -> None:
    if header["kind"] != kind:
        raise ProtocolError(f"expected {kind}, got {header['kind']}", code=ErrorCode.UNKNOWN_KIND)


class _Timed(WireStruct, kw_only=True):
    """Receiver-side timing of one bulk transfer; the body of ``probe.up_result``."""

    total_bytes: Annotated[int, Meta(ge=0, le=1 << 50)] = 0
    timed_bytes: Annotated[int, Meta(ge=0, le=1 << 50)] = 0
    duration_s: Annotated[float, Meta(ge=0.0, le=1e6)] = 0.0

    @property
    def bps(self) -> float | None:
        if self.duration_s <= 0 or self.timed_bytes <= 0:
            return None
        return self.timed_bytes * 8 / self.duration_s


class _DownRequest(WireStruct, kw_only=True):
    """The body of ``probe.down_request``: how much the prober asks the responder to send."""

    nbytes: Annotated[int, Meta(ge=1, le=1 << 40)] = msgspec.field(name="bytes")
    seconds: Annotated[float, Meta(ge=0.0, le=3600.0)]
    frame_bytes: Annotated[int, Meta(ge=1, le=1 << 30)]


async def _receive_bulk(
    conn: Connection, kind: str, timeout: float, first: tuple[dict[str, Any], int] | None = None
) -> _Timed:
    """Receive ``kind`` frames until one has ``last: true``; time them from the end of the first frame.

    ``first`` is ``(header, wire_bytes)`` of a first frame the caller already read.
    """
    timed = _Timed()
    start = time.perf_counter()
    if first is not None:
        header, timed.total_bytes = first
        if header.get("last") is True:
            return timed
    while True:
        before = conn.bytes_received
        header, _payload = await conn.recv(timeout=timeout)
        now = time.perf_counter()
        _expect(header, kind)
        wire = conn.bytes_received - before
        if first is None:  # this is the first frame: the clock starts when it has arrived
            first, start, timed.total_bytes = (header, wire), now, wire
        else:
            timed.total_bytes += wire
            timed.timed_bytes += wire
            timed.duration_s = now - start
        if header.get("last") is True:
            return timed


async def _send_bulk(conn: Connection, kind: str, nbytes: int, seconds: float, frame_bytes: int) -> int:
    """Send ``kind`` frames until ``nbytes`` or ``seconds`` is spent, then an empty ``last`` frame; return frames sent."""
    block = os.urandom(frame_bytes)  # incompressible, in case a future transport compresses
    started = time.perf_counter()
    sent = seq = 0
    while sent < nbytes and time.perf_counter() - started < seconds:
        size = min(frame_bytes, nbytes - sent)
        await conn.send({"kind": kind, "seq": seq, "last": False}, memoryview(block)[:size])
        sent += size
        seq += 1
    await conn.send({"kind": kind, "seq": seq, "last": True})
    return seq + 1


class ProbeResponder:
    """Answers probe sessions from other peers, within its own budget (sessions and answer bytes per
    peer). While ``working()`` (its peer works for a job) it refuses with BUSY a prober whose first
    ping says it holds figures for this link: a bulk leg fills the link for seconds against the
    job's traffic, and that prober keeps what it has; one without figures (a newcomer, or one whose
    last probe failed) is served."""

    def __init__(
        self,
        transport: Transport,
        config: ProbeConfig = ProbeConfig(),
        *,
        clock: Callable[[], float] = time.monotonic,
        working: Callable[[], bool] = lambda: False,
        serving: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        self.transport = transport
        self.config = config
        self.budget = ByteBudget(config.answer_budget, clock)
        self._working = working
        self._serving = serving  # entered around each session (the daemon cuts them out of its idle load)
        self._active = 0
        self.sessions_served = 0
        self.refused_working = 0

    @property
    def active_sessions(self) -> int:
        """Probe sessions being served right now (at most ``max_sessions``; the rest are answered BUSY)."""
        return self._active

    async def start(self) -> None:
        cfg = self.config
        await self.transport.serve(
            PROBE_PROTOCOL, self._handle, limits=cfg.frame_limits, streams=cfg.stream_limits
        )

    async def stop(self) -> None:
        await self.transport.stop_serving(PROBE_PROTOCOL)

    async def _handle(self, conn: Connection) -> None:
        """One session; the transport has granted its slot and enforces its idle and total timeouts."""
        with self._serving():
            await self._session(conn)

    async def _session(self, conn: Connection) -> None:
        cfg = self.config
        peer = conn.peer_id
        self._active += 1
        self.sessions_served += 1
        try:
            while True:
                before = conn.bytes_received
                try:
                    header, _payload = await conn.recv(timeout=cfg.idle_timeout_s)
                except StreamClosed:
                    return
                kind = header["kind"]
                sent = conn.bytes_sent
                if kind == PING and header.get("holds") is True and self._working():
                    self.refused_working += 1
                    await conn.send_error(ErrorCode.BUSY, "working for a job: keep your figures of this link")
                    return
                if kind == PING:
                    await conn.send({"kind": PONG, "seq": header.get("seq")})
                elif kind == UP:
                    timed = await _receive_bulk(
                        conn, UP, cfg.idle_timeout_s, first=(header, conn.bytes_received - before)
                    )
                    await conn.send({"kind": UP_RESULT, **to_builtin(timed)})
                elif kind == DOWN_REQUEST:
                    ask = convert(header, _DownRequest, what=DOWN_REQUEST)
                    frame = min(ask.frame_bytes, cfg.max_frame_bytes)
                    want = min(ask.nbytes, cfg.max_bulk_bytes)
                    # what this peer's budget allows now; less than a few frames would time nothing
                    grant = self.budget.grant(peer, want, at_least=min(want, 4 * frame))
                    try:
                        await _send_bulk(conn, DOWN, grant, min(ask.seconds, cfg.max_bulk_seconds), frame)
                    finally:
                        self.budget.charge(peer, conn.bytes_sent - sent)
                    continue
                else:
                    raise ProtocolError(f"unknown probe message {kind!r}", code=ErrorCode.UNKNOWN_KIND)
                self.budget.charge(peer, conn.bytes_sent - sent)
        finally:
            self._active -= 1


@dataclass(frozen=True)
class _Partial:
    """What a probe session has measured so far (SI: seconds, bit/s)."""

    rtt_s: float | None = None
    up_bps: float | None = None
    down_bps: float | None = None


def published_measurement(probes: Iterable[LinkMeasurement]) -> LinkMeasurement:
    """One successful measurement from several of the same link, as of the newest: the median of
    each bandwidth and the fastest round trip (of the probes that have them). Queueing behind
    whatever else the hosts or the link carried only ever adds to a round trip, for all of one
    probe's pings at times (8 daemons on 2 cores, probing between training runs, published 26 ms
    for a 1.2 ms shaped one-way delay); a bandwidth is what the link gives, shared or not."""
    probes = list(probes)

    def known(values: Iterable[float | None]) -> list[float]:
        return [v for v in values if v is not None]

    def median(values: Iterable[float | None]) -> float | None:
        return statistics.median(found) if (found := known(values)) else None

    newest = max(probes, key=lambda m: m.measured_at)
    return msgspec.structs.replace(
        newest,
        rtt_ms=min(known(m.rtt_ms for m in probes), default=None),
        bw_up_mbps=median(m.bw_up_mbps for m in probes),
        bw_down_mbps=median(m.bw_down_mbps for m in probes),
    )


class LinkProber:
    """Measures links from this peer to others; keeps one ``LinkMeasurement`` per peer: of its last
    ``history`` successful probes the fastest round trip and the median bandwidths
    (``published_measurement``), or the failure of its last probe."""

    def __init__(
        self,
        transport: Transport,
        config: ProbeConfig = ProbeConfig(),
        *,
        now: Callable[[], float] = get_dht_time,
    ) -> None:
        self.transport = transport
        self.config = config
        self._now = now
        self.measurements: dict[str, LinkMeasurement] = {}
        self._recent: dict[str, deque[LinkMeasurement]] = {}  # successful probes, newest last
        self._resting: dict[str, float] = {}  # peer -> until when a BUSY answer spares it (``now`` time)

    def stalest(self, peers: Iterable[PeerID]) -> list[PeerID]:
        """The peers to probe next: never measured first, then oldest measurement first; at most
        ``peers_per_refresh``, none that answered BUSY within ``busy_backoff_s`` (it keeps its figures)."""
        me, now = self.transport.peer_id, self._now()
        unique = {p.to_base58(): p for p in peers if p != me}
        unique = {k: p for k, p in unique.items() if self._resting.get(k, now) <= now}

        def age_key(item: tuple[str, PeerID]) -> tuple[float, str]:
            known = self.measurements.get(item[0])
            return (-float("inf") if known is None else known.measured_at, item[0])

        ordered = sorted(unique.items(), key=age_key)
        return [peer for _, peer in ordered[: self.config.peers_per_refresh]]

    def unmeasured(self, peers: Iterable[str]) -> list[str]:
        """Those of ``peers`` (base58 ids) without a measurement whose status is OK."""
        ok = LinkStatus.OK
        return [p for p in peers if (m := self.measurements.get(p)) is None or m.status is not ok]

    async def refresh(
        self, peers: Iterable[PeerID], *, proceed: Callable[[str], bool] = lambda _peer: True
    ) -> list[LinkMeasurement]:
        """Probe the stalest few of ``peers`` one after another (bulk transfers must not share the uplink).

        ``proceed(peer)`` (a base58 id) is asked before each probe and every ``PROCEED_CHECK_S``
        while one runs; once it says no, that peer is skipped or its probe abandoned: no
        measurement of that run, its link keeps the last one. (A daemon that starts working for a
        job mid-round stops filling its measured links at once, instead of for the rest of the
        round: five bulk probes took 10 s of a job's first steps.)
        """
        results = []
        for peer in self.stalest(peers):
            key = peer.to_base58()
            if not proceed(key):
                continue
            probe = asyncio.create_task(self.probe(peer))
            try:
                while not probe.done():
                    await asyncio.wait({probe}, timeout=PROCEED_CHECK_S)
                    if not probe.done() and not proceed(key):
                        logger.info("abandoned the probe of %s: its link now carries a job's traffic", key)
                        break
            finally:
                if not probe.done():
                    await cancel_and_wait(probe)
            if not probe.cancelled():
                results.append(probe.result())
        return results

    def forget(self, keep: Iterable[PeerID]) -> None:
        """Drop measurements of peers not in ``keep`` (they left the swarm)."""
        alive = {p.to_base58() for p in keep}
        for key in [k for k in self.measurements if k not in alive]:
            del self.measurements[key]
            self._recent.pop(key, None)
        for key in [k for k in self._resting if k not in alive]:
            del self._resting[key]

    async def probe(self, peer: PeerID) -> LinkMeasurement:
        """Probe one peer within ``probe_timeout_s``; failures come back as a measurement with a status."""
        cfg = self.config
        partial: list[_Partial] = [_Partial()]
        status = LinkStatus.OK
        try:
            async with asyncio.timeout(cfg.probe_timeout_s):
                await self._session(peer, partial)
        except TimeoutError:
            status = LinkStatus.TIMEOUT
        except PeerUnavailable as exc:
            if exc.code in (ErrorCode.BUSY, ErrorCode.RATE_LIMITED, ErrorCode.BANNED):
                status = LinkStatus.BUSY  # alive, but not answering this peer right now
            elif exc.code == ErrorCode.TIMEOUT and partial[0].rtt_s is not None:
                status = LinkStatus.TIMEOUT
            else:
                status = LinkStatus.UNREACHABLE
            # a busy peer is routine (it works for a job, or serves other probers)
            logger.log(
                logging.DEBUG if status is LinkStatus.BUSY else logging.INFO,
                "probe of %s failed: %s",
                peer,
                exc,
            )
        except PeerdError as exc:
            status = LinkStatus.ERROR
            logger.warning("probe of %s got a bad answer: %s", peer, exc)
        got = partial[0]
        measurement = LinkMeasurement.from_si(
            peer.to_base58(),
            rtt_s=got.rtt_s,
            bw_up_bps=got.up_bps,
            bw_down_bps=got.down_bps,
            measured_at=self._now(),
            status=status,
        )
        key = measurement.peer_id
        previous = self.measurements.get(key)
        self._resting.pop(key, None)
        if status is LinkStatus.OK:
            recent = self._recent.setdefault(key, deque(maxlen=cfg.history))
            recent.append(measurement)
            self.measurements[key] = published_measurement(recent)
        # BUSY means the peer is alive but working for a job or serving other probers: keep its last
        # good numbers (still the best estimate) instead of blanking the link, and let it be a while
        elif status is LinkStatus.BUSY and previous is not None and previous.status is LinkStatus.OK:
            self._resting[key] = self._now() + cfg.busy_backoff_s
        else:
            self.measurements[key] = measurement
            self._recent.pop(key, None)  # a link that failed starts its figures afresh
        return measurement

    async def _session(self, peer: PeerID, partial: list[_Partial]) -> None:
        cfg = self.config
        conn = await self.transport.connect(peer, PROBE_PROTOCOL, timeout=cfg.connect_timeout_s)
        try:
            timeout = cfg.probe_timeout_s
            # the first ping says whether this peer holds good figures for the link: a responder
            # that works for a job spares its link a bulk probe from a peer that does (BUSY)
            holds = not self.unmeasured([peer.to_base58()])
            rtts = []
            # seq 0 warms the stream up (p2pd's first-use costs) and is not counted
            for seq in range(cfg.pings + 1):
                started = time.perf_counter()
                ping = {"kind": PING, "seq": seq, **({"holds": True} if holds and seq == 0 else {})}
                header, _ = await conn.request(ping, timeout=timeout)
                _expect(header, PONG)
                if header.get("seq") != seq:
                    raise ProtocolError(f"pong for seq {header.get('seq')!r}, expected {seq}")
                rtts.append(time.perf_counter() - started)
            partial[0] = _Partial(rtt_s=min(rtts[1:]))

            await _send_bulk(conn, UP, cfg.bulk_bytes, cfg.bulk_seconds, cfg.frame_bytes)
            header, _ = await conn.recv(timeout=timeout)
            _expect(header, UP_RESULT)
            up = convert(header, _Timed, what=UP_RESULT)
            partial[0] = _Partial(rtt_s=partial[0].rtt_s, up_bps=up.bps)

            request = {"kind": DOWN_REQUEST, "bytes": cfg.bulk_bytes, "seconds": cfg.bulk_seconds}
            await conn.send({**request, "frame_bytes": cfg.frame_bytes})
            down = await _receive_bulk(conn, DOWN, timeout)
            partial[0] = _Partial(rtt_s=partial[0].rtt_s, up_bps=up.bps, down_bps=down.bps)
        finally:
            await conn.close(timeout=1.0)
