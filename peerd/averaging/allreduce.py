"""GroupAllReduce: one member's async shell around ``core.MemberMath`` — streams, step states, timeouts, errors.

Each member serves ``peerd/avg/1/<key>`` to the other members only (the remote's libp2p
peer id is checked against the group; anyone else gets NOT_ALLOWED from the transport) and
keeps one outbound stream per other member, reused across steps. Every stream opens with
``avg.hello`` naming the group and the allocation epoch: a member still averaging for a
superseded allocation is refused (STALE) before any gradient bytes are read. Refusals are
counted by reason in ``AveragingStats.refused``. Per step and per other member ``j``: send ``avg.part`` (my contribution to
share ``j``), receive ``avg.share`` (the average of share ``j``) on the same stream. Inbound
contributions to my share are collected in a per-step state until all ``D`` are in, then
reduced once and the same bytes answer every member.

Frames are accepted for the running step and the next one (a faster member may already
send step ``t+1`` while this one still waits for ``t``); anything else is WRONG_STEP. Every
wait is bounded by ``timeout`` (seconds without progress; a stage worker makes it follow its
step times, ``follow_deadline``), so a vanished member costs the others at most ``timeout``
before a PeerUnavailable. A failed step aborts this member's
state (members waiting on it get an error frame at once, not a timeout), closes its
streams and discards staged error-feedback residuals, so the caller may retry the step
(same tensors -> same bytes) or re-plan. A member that already completed the step (it may
have used the retrying member's part from the failed attempt) answers the retry with the share
it reduced then, the same bytes every member got; older steps are WRONG_STEP.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from hivemind.p2p import PeerID

from peerd.averaging.aggregate import Aggregator, screen
from peerd.averaging.codec import Compressor, decode_share, parse_compressor
from peerd.averaging.core import MemberMath
from peerd.averaging.messages import (
    KIND_PART,
    KIND_SHARE,
    AvgMessage,
    Expect,
    check,
    hello,
    parse,
    parse_hello,
)
from peerd.averaging.partition import flatten, group_digest, layout_of, share_bounds, unflatten
from peerd.averaging.steps import StepBook, StepState
from peerd.compress.gradient import Encoded
from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerMisbehaved, PeerUnavailable, ProtocolError
from peerd.log import get_logger
from peerd.swarm.framing import FrameLimits
from peerd.swarm.transport import Connection, Transport
from peerd.tasks import within

logger = get_logger(__name__)
T = TypeVar("T")

PROTOCOL_PREFIX = "peerd/avg/1/"
_KEY = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
FRAME_SLACK = 64 * 1024  # codec headers (scales, lengths) beyond a share's fp32 values
_CONNECT_PAUSE_S = 0.25  # between connect attempts while a member may not serve yet
FINAL_FLUSH_S = 10.0  # closing the group waits this long for queued bytes to leave (a slow link)
# Flattening, encoding and decoding up to this many values run on the event loop: a hop to a
# worker thread waits for the GIL, which on busy shared cores costs ms, more than the work
# itself (0.1-0.5 ms for 256k float32 values); bigger gradients go to a thread.
INLINE_NUMEL = 1 << 18


@dataclass
class AveragingStats:
    """Counters of one member (wire bytes include frame prefixes and headers)."""

    steps: int = 0
    failed: int = 0
    bytes_sent: int = 0
    raw_bytes_sent: int = 0
    """What the sent parts and shares hold as fp32, counted when ``bytes_sent`` counts their frames
    (a share is counted once its send ends, which may be after this member's step)."""
    bytes_received: int = 0
    values_averaged: int = 0
    """fp32 elements averaged over all completed steps (x 4 = raw gradient bytes)."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Frames and streams refused, by ErrorCode name."""
    refused: dict[str, int] = field(default_factory=dict)
    """Streams refused at their opening, by reason: ``stranger`` (not a member in this epoch),
    ``stale_epoch``, ``future_epoch``, ``bad_hello`` (another group, or no hello first)."""
    last_step_s: float = 0.0
    waited_s: float = 0.0
    """Of the completed steps' time, the seconds before every member's part of this member's share
    was in: the wait for the slowest member to reach the step (plus its part's trip), summed. The
    rest is the exchange itself."""


class GroupAllReduce:
    """Average gradient lists among a fixed, ordered group of replicas of one pipeline stage.

    ``group`` must be the same ordered list on every member; ``key`` names the job and stage
    (it selects the stream protocol and enters the group digest). ``compressor``: None or
    ``"none"`` (fp32, bit-identical on every member), ``"q8"``/``"q4"``/... or a
    GradientCompression. ``timeout``: seconds a step may go without progress. Call ``start()`` on
    every member before its first step (members also retry connecting until ``timeout``) and
    ``close()`` at the end. With a single member ``allreduce`` returns the input tensors themselves.
    """

    def __init__(
        self,
        transport: Transport,
        group: Sequence[PeerID],
        self_id: PeerID | None = None,
        key: str = "default",
        compressor: Compressor = None,
        timeout: float = 30.0,
        epoch: int = 0,
        aggregator: Aggregator | str | None = None,
        max_norm_ratio: float = 1e3,
        loss_scaled: bool = False,
    ) -> None:
        members = list(group)
        self_id = self_id if self_id is not None else transport.peer_id
        if not members or len(set(members)) != len(members):
            raise ConfigError("group", "must be a non-empty list of distinct peer ids")
        if self_id not in members:
            raise ConfigError("group", f"{self_id} is not a member of its own averaging group")
        if not _KEY.fullmatch(key):
            raise ConfigError("key", f"{key!r}: 1-128 characters from [A-Za-z0-9._:/-]")
        if not timeout > 0:
            raise ConfigError("timeout", f"must be > 0, got {timeout}")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError("epoch", f"must be an int >= 0, got {epoch!r}")
        if not (isinstance(max_norm_ratio, int | float) and 1 < max_norm_ratio < float("inf")):
            raise ConfigError("max_norm_ratio", f"must be a finite number > 1, got {max_norm_ratio!r}")
        self.max_norm_ratio = float(max_norm_ratio)
        self.loss_scaled = loss_scaled  # fp16 jobs: members may flag overflowed steps (others may not)
        self.transport = transport
        self.epoch = epoch
        self.members = members
        self.rank = members.index(self_id)
        self.size = len(members)
        self.key = key
        self.initial_timeout = float(timeout)
        self.any_overflowed = False  # the last step: some member's fp16 gradients overflowed
        self._timeout_source: Callable[[], float] | None = None
        self.protocol = PROTOCOL_PREFIX + key
        self.digest = group_digest(key, [m.to_base58() for m in members])
        self.compression = parse_compressor(compressor)
        self.math = MemberMath(self.rank, self.size, self.compression, aggregator)
        self.stats = AveragingStats()
        self._ranks = {m: r for r, m in enumerate(members)}
        self._steps = StepBook(self.rank)
        self._conns: dict[int, Connection] = {}
        self._replying = 0  # averaged shares being handed to the streams we serve
        self._replies_sent = asyncio.Event()  # set while none is
        self._replies_sent.set()
        self._serving = False
        self._closed = False
        self.max_numel: int | None = None
        """The most gradient elements a step of this group averages (set before ``start``): frames
        of the group's streams are then bounded by the largest share's fp32 bytes instead of the
        transport's default (1 GiB), checked against the header before any payload byte is read."""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Serve the group's protocol (idempotent). Start every member before its first step."""
        if self._closed:
            raise PeerUnavailable("averaging group is closed")
        if self.size > 1 and not self._serving:
            await self.transport.serve(
                self.protocol, self._handle, allowed=self._is_member, limits=self.frame_limits()
            )
            self._serving = True

    def frame_limits(self) -> FrameLimits | None:
        """What one frame of this group may carry (None: the transport's default, ``max_numel`` unset)."""
        if self.max_numel is None:
            return None
        share = -(-self.max_numel // self.size)  # the largest share (share_bounds), at 4 B per value
        return FrameLimits(max_payload=share * 4 + FRAME_SLACK)

    @property
    def timeout(self) -> float:
        """Seconds a wait may go without progress: the configured ``timeout``, or what the source given
        to ``follow_deadline`` says now."""
        return self.initial_timeout if self._timeout_source is None else self._timeout_source()

    def follow_deadline(self, seconds: Callable[[], float]) -> None:
        """Take every wait's limit from ``seconds()`` from now on (a stage worker's ``StepDeadline``,
        learnt from its step times: minutes on slow links, seconds on fast ones)."""
        self._timeout_source = seconds

    async def close(self) -> None:
        """Abort pending steps, close streams, stop serving."""
        self._closed = True
        self._steps.abort_all(PeerUnavailable(f"rank {self.rank} closed its averaging group"))
        flush_s = min(self.timeout, FINAL_FLUSH_S)
        # the last step's chunks may still be queued behind a slow (shaped) link: let them go out
        await self._close_connections(flush_s=flush_s)
        # a member whose step is done may still be sending another member its averaged share (a
        # paced send returns only once the frame is queued): stopping the handler now would cut
        # that frame short and fail the other member's step, at the job's last step its re-plan
        with suppress(TimeoutError):
            async with asyncio.timeout(flush_s):
                await self._replies_sent.wait()
        if self._serving:
            self._serving = False
            await self.transport.stop_serving(self.protocol)

    async def __aenter__(self) -> GroupAllReduce:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _is_member(self, peer_id: PeerID) -> bool:
        """The Transport's gate: only the other members of this epoch's group may open the stream."""
        if peer_id in self._ranks and self._ranks[peer_id] != self.rank:
            return True
        self._refuse("stranger", ErrorCode.NOT_ALLOWED)
        logger.info(
            "refused an averaging stream from %s: not in group %s of epoch %d", peer_id, self.key, self.epoch
        )
        return False

    def state_dict(self) -> dict[str, Any]:
        """Error-feedback residuals and the last completed step (for stage checkpoints)."""
        return {"last_step": self._steps.last, "feedback": self.math.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps.last, self._steps.answered = state.get("last_step"), None
        self.math.load_state_dict(state.get("feedback", {}))

    # ------------------------------------------------------------------ the step

    async def allreduce(
        self, step: int, tensors: Sequence[torch.Tensor], overflowed: bool = False
    ) -> list[torch.Tensor]:
        """The mean over the group of each tensor, identical on every member; new tensors like the inputs.

        ``overflowed``: this member's fp16 gradients overflowed (``tensors`` must then be finite, e.g.
        zeros). Afterwards ``any_overflowed`` says whether any member's did, the same on every member:
        then every member skips the step, and no error-feedback residual of it is kept.
        """
        if overflowed and not self.loss_scaled:
            raise ConfigError("overflowed", "only a loss-scaled (fp16) group's members flag overflowed steps")
        self.any_overflowed = overflowed
        if self._closed:
            raise PeerUnavailable("averaging group is closed")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError("step", f"must be an int >= 0, got {step!r}")
        layout = layout_of(tensors)
        if self.size == 1:  # the mean over one replica is its own gradient: the same tensors back
            self._steps.finish(step)
            self.stats.steps += 1
            return list(tensors)
        if self._steps.current is not None:
            raise ConfigError("step", f"allreduce for step {self._steps.current} is still running")
        if self.max_numel is not None and layout.numel > self.max_numel:
            raise ConfigError(
                "gradients", f"{layout.numel} values, the group averages at most {self.max_numel}"
            )
        await self.start()
        started = time.perf_counter()
        try:
            state = self._steps.begin(step, layout.numel, layout.signature())
            flat_N = await _off_loop(layout.numel, flatten, tensors)
            result_N, self.any_overflowed = await self._run(state, flat_N, overflowed)
        except BaseException as exc:
            await self._fail(step, exc)
            raise
        if self.any_overflowed:
            self.math.discard()  # a skipped step leaves the residuals as they were
        else:
            self.math.commit()
        self._steps.finish(step)
        self.stats.steps += 1
        self.stats.values_averaged += layout.numel
        self.stats.last_step_s = time.perf_counter() - started
        if state.all_in is not None:  # parts that came before this member's call cost it no wait
            self.stats.waited_s += max(0.0, state.all_in - started)
        return unflatten(result_N, tensors)

    async def _run(
        self, state: StepState, flat_N: torch.Tensor, overflowed: bool
    ) -> tuple[torch.Tensor, bool]:
        """The averaged flat vector, and whether any member flagged an overflow (every reducer saw every flag)."""
        total, layout = flat_N.numel(), state.layout
        assert layout is not None
        bounds = share_bounds(total, self.size)
        state.scale, own, frames = await _off_loop(total, self._contributions, flat_N)
        self._add_part(state, self.rank, own, overflowed)
        jobs: dict[int, asyncio.Task[tuple[torch.Tensor, bool]]] = {
            self.rank: asyncio.create_task(self._own_share(state))
        }
        for j, payload in frames.items():
            msg = AvgMessage(
                KIND_PART, self.digest, state.step, self.rank, j, total, layout, overflow=overflowed or None
            )
            jobs[j] = asyncio.create_task(self._exchange(j, msg, payload, bounds[j][1] - bounds[j][0]))
        await _first_error(list(jobs.values()))
        result_N = torch.empty(total, dtype=torch.float32)
        any_overflowed = False
        for j, (start, end) in enumerate(bounds):
            share, flagged = jobs[j].result()
            result_N[start:end] = share
            any_overflowed = any_overflowed or flagged
        return result_N, any_overflowed

    async def _own_share(self, state: StepState) -> tuple[torch.Tensor, bool]:
        return (await self._wait_result(state)).decoded, bool(state.overflowed)

    async def _wait_result(self, state: StepState) -> Encoded:
        """The reduced share, or PeerUnavailable(TIMEOUT) after ``timeout`` s without a new contribution."""
        loop = asyncio.get_running_loop()
        while not state.result.done():
            left = state.touched + self.timeout - loop.time()
            if left <= 0 and state.reducing is None:
                missing = [r for r in range(self.size) if r not in state.parts]
                raise PeerUnavailable(
                    f"step {state.step}: no contribution from rank(s) {missing} within {self.timeout:.3g} s",
                    code=ErrorCode.TIMEOUT,
                )
            try:
                await within(asyncio.shield(state.result), max(left, 0.05))
            except TimeoutError:
                continue
        return state.result.result()

    async def _exchange(
        self, j: int, msg: AvgMessage, payload: bytes, numel: int
    ) -> tuple[torch.Tensor, bool]:
        """Send my contribution to share ``j``; receive the averaged share ``j`` back, and its overflow flag."""
        conn = await self._connection(j)
        sent, received, raw = conn.bytes_sent, conn.bytes_received, 0
        try:
            await conn.send(msg.header(), payload, timeout=self.timeout)
            raw = numel * 4
            header, reply = await conn.recv(timeout=self.timeout)
        finally:
            self.stats.bytes_sent += conn.bytes_sent - sent
            self.stats.raw_bytes_sent += raw
            self.stats.bytes_received += conn.bytes_received - received
        try:
            answer = parse(header, KIND_SHARE)
            check(
                answer, Expect(self.digest, src=j, share=j, step=msg.step, total=msg.total, layout=msg.layout)
            )
            return await _off_loop(numel, decode_share, reply, numel), bool(answer.overflow)
        except PeerdError as exc:
            self._count(exc.code)
            raise

    async def _connection(self, j: int) -> Connection:
        conn = self._conns.get(j)
        if conn is not None and not conn.closed:
            return conn
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:  # the member may not serve yet (it is still starting): retry until the deadline
            try:
                conn = await self.transport.connect(
                    self.members[j], self.protocol, timeout=deadline - loop.time()
                )
                break
            except PeerUnavailable:
                if loop.time() + _CONNECT_PAUSE_S >= deadline:
                    raise
                await asyncio.sleep(_CONNECT_PAUSE_S)
        limits = self.frame_limits()
        if limits is not None:  # the averaged shares coming back are bounded like the parts served
            conn.limits = limits
        try:
            await conn.send(hello(self.digest, self.epoch).header(), timeout=self.timeout)
        except PeerdError:
            await conn.close(timeout=0.1)
            raise
        self._conns[j] = conn
        return conn

    async def _fail(self, step: int, exc: BaseException) -> None:
        self.stats.failed += 1
        self._steps.fail(step, PeerUnavailable(f"step {step} aborted on rank {self.rank}: {exc}"))
        self.math.discard()
        await self._close_connections()  # late replies of this attempt must not answer a retry
        logger.info("averaging %s step %d failed on rank %d: %s", self.key, step, self.rank, exc)

    async def _close_connections(self, flush_s: float = 1.0) -> None:
        conns, self._conns = list(self._conns.values()), {}
        await asyncio.gather(*(conn.close(timeout=flush_s) for conn in conns))

    # ------------------------------------------------------------------ reduction

    def _add_part(self, state: StepState, src: int, part: torch.Tensor, overflowed: bool = False) -> None:
        state.add(src, part, overflowed)
        if state.reducing is None and len(state.parts) == self.size:
            state.all_in = time.perf_counter()
            state.reducing = asyncio.create_task(self._reduce(state))

    async def _reduce(self, state: StepState) -> None:
        try:
            parts = [state.parts[r] for r in range(self.size)]
            encoded = await _off_loop(parts[0].numel(), self._screened_reduce, parts, state.scale)
        except (
            PeerMisbehaved
        ) as exc:  # nobody averages the absurd values: the step fails, the runner suspects
            logger.warning("averaging %s step %d: refusing %s", self.key, state.step, exc.message)
            self._count(exc.code)
            state.abort(exc)
            return
        except PeerdError as exc:
            state.abort(exc)
            return
        except Exception as exc:  # a bug: fail the step rather than leave its waiters hanging
            logger.exception("averaging reduction failed")
            state.abort(PeerdError(f"reduction failed: {exc}"))
            return
        state.parts.clear()
        if not state.result.done():
            state.result.set_result(encoded)

    def _contributions(self, flat_N: torch.Tensor) -> tuple[float, torch.Tensor, dict[int, bytes]]:
        """The norm of this member's whole gradient, its own share and a frame per other rank."""
        own, frames = self.math.contributions(flat_N)
        return float(torch.linalg.vector_norm(flat_N)), own, frames

    def _screened_reduce(self, parts: list[torch.Tensor], scale: float) -> Encoded:
        screen(parts, self.rank, scale, self.max_norm_ratio, [str(m) for m in self.members])
        return self.math.reduce(parts)

    # ------------------------------------------------------------------ serving

    async def _handle(self, conn: Connection) -> None:
        """Serve one member's stream: contributions in, averaged shares out, errors as error frames."""
        src = self._ranks[conn.peer_id]
        admitted = False  # until the stream's avg.hello named this group and epoch
        while True:
            sent, received, raw = conn.bytes_sent, conn.bytes_received, 0
            try:
                header, payload = await conn.recv(timeout=self.timeout)
            except PeerUnavailable as exc:
                if exc.code == ErrorCode.TIMEOUT and not conn.closed:
                    continue  # idle between steps
                return
            except ProtocolError as exc:  # stream out of sync: the transport reports and closes it
                self._count(exc.code)
                raise
            if not admitted:
                self._admit(conn, header)  # raises: the transport sends its code and closes the stream
                admitted = True
                continue
            try:
                msg = parse(header, KIND_PART)
                check(msg, Expect(self.digest, src=src, share=self.rank))
                if msg.overflow and not self.loss_scaled:
                    raise ProtocolError(
                        f"avg.part of step {msg.step} flags an overflow: this group does not scale its loss",
                        code=ErrorCode.NOT_ALLOWED,
                    )
                start, end = share_bounds(msg.total, self.size)[self.rank]
                state = self._steps.late(msg.step)
                if state is not None:
                    # This member finished the step (maybe with the sender's part from an attempt
                    # that failed on the sender's side): the sender's retry gets the share everyone got.
                    check(msg, Expect(self.digest, total=state.total, layout=state.layout))
                    logger.debug("averaging %s: rank %d's late part of step %d", self.key, src, msg.step)
                else:
                    state = await self._take_part(msg, src, payload, end - start)
                del payload
                encoded = await self._wait_result(state)
                reply = AvgMessage(
                    KIND_SHARE,
                    self.digest,
                    msg.step,
                    self.rank,
                    self.rank,
                    msg.total,
                    msg.layout,
                    overflow=bool(state.overflowed) or None,  # every contribution is in: the flags are final
                )
                self._replying += 1
                self._replies_sent.clear()
                try:
                    await conn.send(reply.header(), encoded.payload, timeout=self.timeout)
                finally:
                    self._replying -= 1
                    if not self._replying:
                        self._replies_sent.set()
                raw = (end - start) * 4
            except PeerdError as exc:
                # the step's own failures (a member gone, a contribution refused) are counted where they happen
                if exc.code not in (ErrorCode.PEER_UNAVAILABLE, ErrorCode.TIMEOUT) and not isinstance(
                    exc, PeerMisbehaved
                ):
                    self._count(exc.code)
                if conn.closed:
                    return
                await conn.send_error(exc.code, str(exc))
            finally:
                self.stats.bytes_sent += conn.bytes_sent - sent
                self.stats.raw_bytes_sent += raw
                self.stats.bytes_received += conn.bytes_received - received

    async def _take_part(self, msg: AvgMessage, src: int, payload: bytearray, numel: int) -> StepState:
        """Check, decode and record ``src``'s contribution; the step state it joined."""
        self._steps.check_window(msg.step)
        held = self._steps.states.get(msg.step)
        if held is not None and held.total is not None:  # before decoding: sizes must agree
            check(msg, Expect(self.digest, total=held.total, layout=held.layout))
        part = await _off_loop(numel, decode_share, payload, numel)
        state = self._steps.admit(msg, self.digest)
        self._add_part(state, src, part, bool(msg.overflow))
        return state

    def _admit(self, conn: Connection, header: dict[str, Any]) -> None:
        try:
            parse_hello(header, self.digest, self.epoch)
        except ProtocolError as exc:
            reason = {ErrorCode.STALE: "stale_epoch", ErrorCode.FROM_FUTURE: "future_epoch"}.get(
                exc.code, "bad_hello"
            )
            self._refuse(reason, exc.code)
            logger.info("refused an averaging stream from %s: %s", conn.peer_id, exc)
            raise

    def _count(self, code: ErrorCode) -> None:
        self.stats.rejected[code.name] = self.stats.rejected.get(code.name, 0) + 1

    def _refuse(self, reason: str, code: ErrorCode) -> None:
        self.stats.refused[reason] = self.stats.refused.get(reason, 0) + 1
        self._count(code)


async def _first_error(tasks: list[asyncio.Task]) -> None:
    """Wait for all ``tasks``; on the first failure cancel the rest and raise it."""
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def _off_loop(numel: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` inline for up to ``INLINE_NUMEL`` values, else in a worker thread."""
    if numel <= INLINE_NUMEL:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
