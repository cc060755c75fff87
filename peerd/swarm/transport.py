"""Framed, authenticated, optionally shaped streams between peers, on hivemind's binary stream handlers.

``Transport(p2p)`` serves named protocols and opens connections; a ``Connection`` is one
libp2p stream bound to the authenticated remote peer id, carrying frames
(``peerd.swarm.framing``; spec in protocols/transport.md). Every remote wait has a timeout;
``connect`` retries within its deadline with capped, jittered backoff and bans a peer for a
while after repeated failures (style.md principle 7). Errors a handler raises reach the
remote as an ``error`` frame carrying the ErrorCode, and come out of its ``recv`` as the
matching typed exception.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P, P2PDaemonError, PeerID

from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerUnavailable, ProtocolError
from peerd.log import get_logger
from peerd.swarm.bans import GARBAGE_CODES, BanList, BanPolicy, Offence
from peerd.swarm.faults import Cut
from peerd.swarm.framing import (
    DEFAULT_LIMITS,
    ERROR_KIND,
    PREFIX_LEN,
    FrameLimits,
    Header,
    Payload,
    StreamClosed,
    error_from_header,
    error_header,
    read_body,
    read_prefix,
    write_frame,
)
from peerd.swarm.limits import DEFAULT_STREAM_LIMITS, OPEN_STREAM_LIMITS, StreamLimits, StreamSlots
from peerd.swarm.retry import PeerBans, RetryPolicy
from peerd.swarm.shaper import LinkShaper, ShapedChannel

__all__ = [
    "Connection",
    "FrameLimits",
    "PeerBans",
    "RetryPolicy",
    "StreamClosed",
    "StreamLimits",
    "Traffic",
    "Transport",
    "create_p2p",
]

logger = get_logger(__name__)

# How p2pd refuses a stream to a peer that is reachable but has no handler for the protocol.
_NOT_SERVED = "protocols not supported"

SERVER_LINGER_S = 2.0  # a served stream waits this long for the opener to close first (see Connection.close)
# PeerUnavailable codes a handler raises to refuse work (sent to the remote), not because the remote vanished
_REFUSAL_CODES = frozenset({ErrorCode.BUSY, ErrorCode.RATE_LIMITED, ErrorCode.BANNED})
REFUSAL_LINGER_S = (
    0.5  # a refused stream (not allowed, over its limits) lingers less: it carries one error frame
)
MAX_TRAFFIC_PEERS = 4096  # per-peer traffic counters kept; peers without open streams are forgotten first
MAX_LINGERING_REFUSALS = 64  # beyond this many refusals at once, refused streams are closed without a word

Handler = Callable[["Connection"], Awaitable[None]]
Allowed = Callable[[PeerID], bool]


@dataclass
class Traffic:
    """Bytes and frames exchanged with one peer (all protocols), as seen by this process."""

    bytes_sent: int = 0
    bytes_received: int = 0
    frames_sent: int = 0
    frames_received: int = 0


class Connection:
    """One framed stream to an authenticated peer. ``send``/``recv`` may run concurrently with each other."""

    def __init__(
        self,
        peer_id: PeerID,
        protocol: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        channel: ShapedChannel | None,
        limits: FrameLimits,
        traffic: Traffic,
        on_close: Callable[[Connection], None] | None = None,
        max_wait: float | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.protocol = protocol
        self.limits = limits
        self.traffic = traffic
        self.bytes_sent = 0  # wire bytes of this stream (frames_* and other streams: ``traffic``)
        self.bytes_received = 0
        self._reader = reader
        self._writer = writer
        self._channel = channel
        self._on_close = on_close
        self._send_lock = asyncio.Lock()
        self._recv_lock = asyncio.Lock()
        self._closed = False
        self._recv_broken: ProtocolError | None = None
        self._send_timeout: float | None = None
        # served streams: the protocol's idle timeout caps every wait on the remote (StreamLimits)
        self.max_wait = max_wait

    def __repr__(self) -> str:
        return f"<Connection {self.protocol} peer={self.peer_id} closed={self._closed}>"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def shaped(self) -> bool:
        return self._channel is not None

    async def send(
        self, header: Mapping[str, Any], payload: Payload = b"", *, timeout: float | None = 60.0
    ) -> None:
        """Send one frame. ``timeout`` bounds each stall (the remote not reading), not the whole transfer."""
        if self._closed:
            raise PeerUnavailable(f"connection to {self.peer_id} is closed")
        timeout = _capped(timeout, self.max_wait)
        async with self._send_lock:
            self._send_timeout = timeout
            try:
                nbytes = await write_frame(self._write, header, payload, chunk=self.limits.chunk)
            except ProtocolError:
                raise  # the header was not encodable: nothing was written
            except TimeoutError:
                self._abort()
                raise PeerUnavailable(
                    f"{self.peer_id} stopped reading for {timeout} s", code=ErrorCode.TIMEOUT
                ) from None
            except PeerUnavailable:
                self._abort()
                raise
            except (ConnectionError, OSError, RuntimeError) as exc:
                self._abort()
                raise PeerUnavailable(f"stream to {self.peer_id} broke: {exc}") from None
        self.bytes_sent += nbytes
        self.traffic.bytes_sent += nbytes
        self.traffic.frames_sent += 1

    async def _write(self, data: memoryview) -> None:
        async with asyncio.timeout(self._send_timeout):
            if self._channel is not None:
                await self._channel.write(data)
            else:
                self._writer.write(data)
                await self._writer.drain()

    async def send_error(self, code: ErrorCode, message: str) -> None:
        """Tell the remote why its request failed (it raises the matching typed error)."""
        await self.send(error_header(code, message), timeout=5.0)

    async def recv(self, timeout: float | None = 30.0) -> tuple[Header, bytearray]:
        """Receive one frame ``(header, payload)``.

        Raises the typed error an ``error`` frame stands for; ``StreamClosed`` when the remote
        closed cleanly; PeerUnavailable(TIMEOUT) when no frame starts within ``timeout``
        (the connection stays usable) or a started frame stalls for ``timeout`` (it is closed).
        """
        if self._closed:
            raise PeerUnavailable(f"connection to {self.peer_id} is closed")
        if self._recv_broken is not None:
            raise ProtocolError(f"stream from {self.peer_id} is out of sync: {self._recv_broken}")
        timeout = _capped(timeout, self.max_wait)
        async with self._recv_lock:
            started = False  # a timeout before the prefix consumed nothing: the stream stays usable
            try:
                header_len, payload_len = await read_prefix(self._reader, limits=self.limits, timeout=timeout)
                started = True
                header, payload = await read_body(
                    self._reader, header_len, payload_len, limits=self.limits, timeout=timeout
                )
            except PeerUnavailable as exc:
                if exc.code != ErrorCode.TIMEOUT or started:
                    self._abort()
                raise
            except ProtocolError as exc:
                # The byte stream is out of sync and nothing after this can be trusted, but the
                # send side stays open so the handler can still tell the remote what was wrong.
                self._recv_broken = exc
                raise
        wire = PREFIX_LEN + header_len + payload_len
        self.bytes_received += wire
        self.traffic.bytes_received += wire
        self.traffic.frames_received += 1
        if header["kind"] == ERROR_KIND:
            raise error_from_header(header)
        return header, payload

    async def request(
        self, header: Mapping[str, Any], payload: Payload = b"", *, timeout: float | None = 30.0
    ) -> tuple[Header, bytearray]:
        """``send`` then ``recv`` the reply (one outstanding request per connection)."""
        await self.send(header, payload, timeout=timeout)
        return await self.recv(timeout=timeout)

    async def close(self, timeout: float = 5.0, *, linger: float = 0.0) -> None:
        """Flush queued (shaped) bytes within ``timeout``, then close the stream.

        ``linger`` > 0: first wait up to that long for the remote to close its side, discarding
        what it still sends. p2pd resets a stream closed with unread input, which can drop our
        last frames (e.g. an error frame) before the remote reads them; lingering lets the
        remote read them and close first.
        """
        if self._closed:
            return
        if self._channel is not None:
            with suppress(PeerdError, TimeoutError, ConnectionError, OSError):
                async with asyncio.timeout(timeout):
                    await self._channel.flush()
        if linger > 0:
            await self._linger(linger)
        self._abort()
        with suppress(Exception):
            async with asyncio.timeout(1.0):
                await self._writer.wait_closed()

    async def _linger(self, seconds: float, max_bytes: int = 4 << 20) -> None:
        discarded = 0
        with suppress(TimeoutError, ConnectionError, OSError):
            async with asyncio.timeout(seconds):
                while discarded < max_bytes:
                    data = await self._reader.read(64 * 1024)
                    if not data:
                        return
                    discarded += len(data)

    def _abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._channel is not None:
            self._channel.close()
        self._writer.close()
        if self._on_close is not None:
            self._on_close(self)

    async def __aenter__(self) -> Connection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class _SessionExpired(PeerdError):
    """A served stream outlived its protocol's session timeout (sent to the remote as TIMEOUT)."""

    code = ErrorCode.TIMEOUT


def _capped(timeout: float | None, cap: float | None) -> float | None:
    if cap is None:
        return timeout
    return cap if timeout is None else min(timeout, cap)


@dataclass
class _Served:
    handler: Handler
    allowed: Allowed | None
    limits: FrameLimits
    streams: StreamLimits
    slots: StreamSlots
    tasks: set[asyncio.Task] = field(default_factory=set)


async def create_p2p(initial_peers: Sequence[Any] = (), *, startup_timeout: float = 30.0) -> P2P:
    """A bare loopback ``P2P`` (no DHT) for benchmarks and tools; the daemon's P2P comes from SwarmNode."""
    return await P2P.create(initial_peers=list(initial_peers), startup_timeout=startup_timeout)


class Transport:
    """Serves and opens framed protocols over one hivemind ``P2P`` (shared with the DHT)."""

    def __init__(
        self,
        p2p: P2P,
        shaper: LinkShaper | None = None,
        *,
        limits: FrameLimits = DEFAULT_LIMITS,
        streams: StreamLimits = DEFAULT_STREAM_LIMITS,
        open_streams: StreamLimits = OPEN_STREAM_LIMITS,
        retry: RetryPolicy = RetryPolicy(),
        ban_policy: BanPolicy = BanPolicy(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.p2p = p2p
        self.shaper = shaper
        self.limits = limits
        self.streams = streams  # protocols with an allow-list
        self.open_streams = open_streams  # protocols any peer may open
        self.refusals: dict[ErrorCode, int] = {}  # streams refused before their handler ran, by code
        # streams a handler ended on the peer's fault (a refused hello, a spent budget, garbage), by code
        self.rejections: dict[ErrorCode, int] = {}
        self._lingering_refusals = 0
        self.retry = retry
        self.bans = PeerBans(retry, clock)  # peers we failed to reach (connect backs off)
        # peers that misbehaved on streams they opened to us: refused with BANNED for a while;
        # ``banlist.subscribe(fn)`` tells a listener (the churn detector) of every new ban
        self.banlist = BanList(ban_policy, clock)
        # swarm access control: when set, only peers it admits may open any stream (NOT_ALLOWED otherwise)
        self.admit: Allowed | None = None
        self.traffic: dict[PeerID, Traffic] = {}
        self.cut = Cut()  # fault injection: peers this transport neither reaches nor hears for a while
        self._served: dict[str, _Served] = {}
        self._stale: set[str] = set()  # protocols p2pd may hold a handler of that no serve() owns
        self._connections: set[Connection] = set()
        self._closed = False

    @property
    def peer_id(self) -> PeerID:
        return self.p2p.peer_id

    async def serve(
        self,
        protocol: str,
        handler: Handler,
        allowed: Allowed | None = None,
        *,
        limits: FrameLimits | None = None,
        streams: StreamLimits | None = None,
    ) -> None:
        """Run ``handler(conn)`` for every stream a peer opens on ``protocol``; peers failing ``allowed`` are refused.

        ``limits`` bound each frame, ``streams`` how many streams a peer (and everyone) may hold
        open and for how long (default: the transport's ``streams``, or its stricter
        ``open_streams`` for a protocol without ``allowed``, which strangers can open). When the handler returns the stream is
        closed; a PeerdError it raises is sent to the remote as an error frame with its code,
        anything else as INTERNAL.
        """
        if protocol in self._served:
            raise ConfigError("protocol", f"{protocol!r} is already served")
        stream_limits = streams or (self.streams if allowed is not None else self.open_streams)
        served = self._served[protocol] = _Served(
            handler, allowed, limits or self.limits, stream_limits, StreamSlots(stream_limits)
        )

        async def on_stream(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if self._served.get(protocol) is not served:  # a registration its serve() gave up on
                writer.close()
                return
            await self._handle_stream(protocol, served, info.peer_id, reader, writer)

        try:
            if protocol in self._stale:  # p2pd refuses a second handler for a protocol
                await self._remove_handler(protocol)
            await self.p2p.add_binary_stream_handler(protocol, on_stream)
        except BaseException as exc:
            # refused by the local p2pd, or cancelled (a re-plan stopping a tasklet that was
            # starting): the protocol must not stay "served" with nobody to stop it, or the next
            # epoch's serve fails; p2pd may hold the handler until the next serve replaces it,
            # and on_stream drops what reaches it
            self._served.pop(protocol, None)
            self._stale.add(protocol)
            if isinstance(exc, (P2PDaemonError, ConnectionError, OSError)):
                raise PeerUnavailable(
                    f"cannot serve {protocol}: the p2p daemon refused the handler: {exc}"
                ) from None
            raise
        self._stale.discard(protocol)

    async def stop_serving(self, protocol: str) -> None:
        served = self._served.pop(protocol, None)
        if served is None and protocol not in self._stale:
            return
        self._stale.add(protocol)  # until p2pd has dropped the handler: a cancel may cut that short
        await self._remove_handler(protocol)
        for task in list(served.tasks) if served is not None else []:
            task.cancel()

    async def _remove_handler(self, protocol: str) -> None:
        try:
            await self.p2p.remove_binary_stream_handler(protocol)
        except (P2PDaemonError, ConnectionError, OSError) as exc:  # stays stale: the next serve retries
            logger.debug("removing the p2p handler of %s failed: %s", protocol, exc)
            return
        self._stale.discard(protocol)

    def cut_off(self, cut: Cut) -> None:
        """Fault injection: drop every stream with ``cut``'s peers now, open or accept none until it ends."""
        self.cut = cut
        for conn in list(self._connections):
            if cut.blocks(conn.peer_id.to_base58()):
                conn._abort()

    async def connect(self, peer_id: PeerID, protocol: str, timeout: float = 10.0) -> Connection:
        """Open a stream to ``peer_id`` speaking ``protocol``, retrying within ``timeout`` seconds."""
        if self._closed:
            raise PeerUnavailable("this transport is closed")
        if self.cut.blocks(peer_id.to_base58()):
            raise PeerUnavailable(f"cannot open {protocol} to {peer_id}: cut off by fault injection")
        banned = self.bans.remaining(peer_id)
        if banned > 0:
            raise PeerUnavailable(f"{peer_id} is banned for {banned:.1f} s more after repeated failures")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last_error, code = "no attempt fit in the timeout", ErrorCode.TIMEOUT
        attempt = 0
        while (left := deadline - loop.time()) > 0:
            try:
                async with asyncio.timeout(left):
                    _info, reader, writer = await self.p2p.call_binary_stream_handler(peer_id, protocol)
            except TimeoutError:
                last_error, code = f"no stream within {timeout:.3g} s", ErrorCode.TIMEOUT
                break
            except (P2PDaemonError, ConnectionError, OSError) as exc:
                last_error, code = str(exc), ErrorCode.PEER_UNAVAILABLE
                pause = self.bans.backoff(attempt)
                attempt += 1
                # The peer is up but serves no handler for the protocol yet (a pipeline neighbour that
                # adopts the same commit one poll later): that is worth the whole timeout, not 3 tries.
                not_served_yet = _NOT_SERVED in last_error
                if (attempt >= self.retry.attempts and not not_served_yet) or loop.time() + pause >= deadline:
                    break
                logger.debug("connect %s %s failed (%s); retry in %.2f s", peer_id, protocol, exc, pause)
                await asyncio.sleep(pause)
                continue
            self.bans.succeeded(peer_id)
            return self._connection(peer_id, protocol, reader, writer, self.limits)
        self.bans.failed(peer_id)
        raise PeerUnavailable(f"cannot open {protocol} to {peer_id}: {last_error}", code=code)

    async def close(self) -> None:
        """Stop serving, cancel running handlers and close every open connection."""
        self._closed = True
        for protocol in list(self._served):
            await self.stop_serving(protocol)
        for conn in list(self._connections):
            await conn.close(timeout=1.0)

    def _connection(
        self,
        peer_id: PeerID,
        protocol: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        limits: FrameLimits,
        max_wait: float | None = None,
    ) -> Connection:
        channel = self.shaper.channel(peer_id, writer) if self.shaper is not None else None
        conn = Connection(
            peer_id,
            protocol,
            reader,
            writer,
            channel=channel,
            limits=limits,
            traffic=self._traffic_of(peer_id),
            on_close=self._connections.discard,
            max_wait=max_wait,
        )
        self._connections.add(conn)
        return conn

    def _traffic_of(self, peer_id: PeerID) -> Traffic:
        traffic = self.traffic.get(peer_id)
        if traffic is None:
            if len(self.traffic) >= MAX_TRAFFIC_PEERS:  # a bounded table: strangers come and go
                busy = {conn.peer_id for conn in self._connections}
                for old in [p for p in self.traffic if p not in busy][: len(self.traffic) // 4 + 1]:
                    del self.traffic[old]
            traffic = self.traffic[peer_id] = Traffic()
        return traffic

    def slots(self, protocol: str) -> StreamSlots | None:
        """The stream slots of a served protocol (how many streams each peer holds now), or None."""
        served = self._served.get(protocol)
        return served.slots if served is not None else None

    async def _handle_stream(
        self,
        protocol: str,
        served: _Served,
        peer_id: PeerID,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        if self.cut.blocks(peer_id.to_base58()):  # a partition: no answer at all
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        served.tasks.add(task)
        conn = self._connection(
            peer_id, protocol, reader, writer, served.limits, served.streams.idle_timeout_s
        )
        linger = SERVER_LINGER_S
        slot = lingering_refusal = False
        try:
            refusal = self._refusal(protocol, served, peer_id)
            if refusal is None:
                served.slots.acquire(peer_id)  # raises RATE_LIMITED / BUSY: refused below
                slot = True
                await self._run_handler(protocol, served, conn)
            else:
                raise refusal
        except PeerUnavailable as exc:
            self._judge(peer_id, protocol, exc)
            if not slot:  # refused before the handler ran: say why, briefly
                linger = await self._refuse(conn, protocol, exc)
                lingering_refusal = linger > 0
            elif exc.code in _REFUSAL_CODES:  # the handler refused more work (e.g. a spent byte budget)
                self._rejected(exc)
                logger.info("%s stream from %s refused: %s", protocol, peer_id, exc)
                await self._try_send_error(conn, exc.code, exc.message)
            else:  # the remote went away or stalled: nobody left to tell
                logger.debug("%s stream from %s ended: %s", protocol, peer_id, exc)
        except ProtocolError as exc:
            self._judge(peer_id, protocol, exc)
            if not slot:
                linger = await self._refuse(conn, protocol, exc)
                lingering_refusal = linger > 0
            else:
                self._rejected(exc)
                logger.info("%s stream from %s failed: %s", protocol, peer_id, exc)
                await self._try_send_error(conn, exc.code, exc.message)
        except PeerdError as exc:
            self._judge(peer_id, protocol, exc)
            logger.info("%s stream from %s failed: %s", protocol, peer_id, exc)
            await self._try_send_error(conn, exc.code, exc.message)
        except asyncio.CancelledError:
            # Cancelled by stop_serving/close. This task belongs to asyncio's unix server, whose
            # done-callback in Python 3.11 calls task.exception() and logs a spurious error for a
            # cancelled task; ending normally is safe because nothing awaits this task's result.
            logger.debug("%s stream from %s cancelled", protocol, peer_id)
            linger = 0.0
        except Exception as exc:
            logger.exception("%s handler failed on a stream from %s", protocol, peer_id)
            await self._try_send_error(conn, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            if slot:
                served.slots.release(peer_id)
            served.tasks.discard(task)
            try:
                await conn.close(linger=linger)
            except asyncio.CancelledError:  # see above: end the task normally
                conn._abort()
            finally:
                if lingering_refusal:
                    self._lingering_refusals -= 1

    def _rejected(self, exc: PeerdError) -> None:
        if not exc.from_remote:  # an error frame the remote sent us is its verdict, not ours
            self.rejections[exc.code] = self.rejections.get(exc.code, 0) + 1

    def _judge(self, peer_id: PeerID, protocol: str, exc: PeerdError) -> None:
        """Count an offence when ``exc`` ended ``peer_id``'s stream through the peer's own fault."""
        if exc.from_remote:  # the remote told us about an error of ours: nothing to hold against it
            return
        if exc.code in GARBAGE_CODES:
            self.banlist.report(peer_id, Offence.GARBAGE, f"{protocol}: {exc.message}")
        elif exc.code == ErrorCode.RATE_LIMITED or isinstance(exc, _SessionExpired):
            self.banlist.report(peer_id, Offence.OVER_LIMIT, f"{protocol}: {exc.message}")

    def _refusal(self, protocol: str, served: _Served, peer_id: PeerID) -> PeerdError | None:
        """Why a new stream of ``peer_id`` is refused before its handler runs, or None."""
        banned = self.banlist.remaining(peer_id)
        if banned > 0:
            return PeerUnavailable(
                f"banned for {banned:.1f} s more after garbage or exceeded limits", code=ErrorCode.BANNED
            )
        if self.admit is not None and not self.admit(peer_id):
            return ProtocolError(
                f"{protocol}: not a member of this swarm (no record with the swarm secret's proof)",
                code=ErrorCode.NOT_ALLOWED,
            )
        if served.allowed is not None and not served.allowed(peer_id):
            return ProtocolError(f"{protocol}: peer not allowed", code=ErrorCode.NOT_ALLOWED)
        return None

    async def _refuse(self, conn: Connection, protocol: str, exc: PeerdError) -> float:
        """Send the refusal's error frame; return how long the stream may linger (0 under a refusal flood)."""
        self.refusals[exc.code] = self.refusals.get(exc.code, 0) + 1
        logger.info("refused %s stream from %s: %s", protocol, conn.peer_id, exc)
        if self._lingering_refusals >= MAX_LINGERING_REFUSALS:
            return 0.0  # a flood of refused streams: close them at once, without a word
        self._lingering_refusals += 1  # the caller gives it back after the linger
        await self._try_send_error(conn, exc.code, exc.message)
        return REFUSAL_LINGER_S

    async def _run_handler(self, protocol: str, served: _Served, conn: Connection) -> None:
        """The handler within the protocol's session timeout (a TIMEOUT error when it runs out)."""
        limit = served.streams.session_timeout_s
        try:
            async with asyncio.timeout(limit) as deadline:
                await served.handler(conn)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise _SessionExpired(
                f"{protocol}: stream open longer than {limit:.3g} s (the session limit)",
                code=ErrorCode.TIMEOUT,
            ) from None

    @staticmethod
    async def _try_send_error(conn: Connection, code: ErrorCode, message: str) -> None:
        if conn.closed:
            return
        with suppress(PeerdError):
            await conn.send_error(code, message)


@asynccontextmanager
async def loopback_pair() -> AsyncIterator[tuple[P2P, P2P, Transport, Transport]]:
    """Two bare p2pd daemons on loopback (``b`` bootstraps from ``a``) and a Transport on each, all
    closed on exit: what benchmarks and the messaging-cost measurement send through."""
    a = await create_p2p()
    try:
        b = await create_p2p(await a.get_visible_maddrs())
        ta, tb = Transport(a), Transport(b)
        try:
            yield a, b, ta, tb
        finally:
            await tb.close()
            await ta.close()
            await b.shutdown()
    finally:
        await a.shutdown()
