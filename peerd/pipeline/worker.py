"""StageWorker: one tasklet (stage i, replica j) of a pipeline job — compute, streams, averaging, optimizer, checkpoints.

Per step the worker runs its stage's action list from the micro-batch schedule: it receives
activations from its upstream neighbour and gradients from its downstream neighbour
(``peerd.pipeline.streams``), runs forward and backward in its own compute thread (the event
loop keeps serving the streams meanwhile), encodes what it sends with the boundary codecs
(AC-SGD forward, quantized backward, or raw), and after the last micro-batch averages its
parameter gradients with the stage's other replicas through a pluggable ``Reducer`` (the
averaging group's all-reduce; none when the stage has one replica), then, with gradient
clipping on (or under fp16 with more than one stage: the overflow verdict), joins the replica's
cross-stage norm exchange (``peerd.pipeline.optim``: partial sums of squares upstream, the total
back downstream, on the same streams) and steps the optimizer and its LR schedule.
Stage 0 reads inputs by example id, the last stage reads labels by example id: only hidden
states and their gradients cross the network. Any typed failure aborts the step on this
worker and tells both neighbours, so the whole pipeline fails fast instead of waiting out
timeouts. The arithmetic is that of ``peerd.pipeline.local.train_pipelined``: same layers,
same micro-batch loss weights, same optimizer, schedule and clipping, so an uncompressed run
reproduces it.

State for churn recovery: a step's update (averaged gradients assigned and clipped,
optimizer and LR-scheduler step, ``self.step += 1``) is one call (in the compute thread, or on
the loop when short), so cancelling ``run`` or ``train_step`` at any await never leaves a
half-applied step; ``quiesce`` waits for that call to finish.
With ``TrainConfig.rollback`` the worker keeps a host copy of the state from just before the
last update, so it can serve both ``self.step - 1`` and ``self.step`` (``available_steps``,
``state_at``): survivors that stopped one update apart can all resume from the older step.
``load_state`` accepts a state from any replica of the same stage (elastic D_DP).

Devices: the stage module, its optimizer state, the boundary codecs with their AC-SGD buffers
and the data batches live on ``TrainConfig.device`` (resolved here: ``auto`` is the first CUDA
device, else MPS, else the CPU). All device work runs in the compute thread, not on the event
loop (on a CPU stage, a call whose last run was shorter than a thread hand-off,
``INLINE_COMPUTE_S``, runs on the loop while the thread is idle): received tensors move to the
device there, and what leaves the device (payloads, the gradients handed to the averaging
group, states for checkpoints and peers) is copied out there into host memory (pinned, non-blocking on CUDA: ``peerd.compress.device``). On a device, the
stream receiver decodes every message off the event loop (a decode may wait on the device).
States load back onto this worker's device whatever device saved them.

Validation (``data.validation``): after the update of every step that completes an evaluation
interval (and after the last step), each tasklet runs its replica's held-out micro-batches
(``peerd.data.validation``) forward only, in eval mode and without autograd: stage 0 reads the
inputs by example id, every stage sends its output downstream as a raw float32 ``pp.val``
message, and the last stage reads the labels and reports the replica's mean held-out loss
(``StepReport.val_loss``). No gradient, optimizer state, LR schedule or AC-SGD buffer is
touched, and nothing flows back upstream.
Out of memory (CUDA's, or the host's ``MemoryError``) in a step ends it with ``StageOutOfMemory``,
whose message carries what was asked for and what was free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from peerd.compress.device import host_copy, to_host
from peerd.data.config import build_dataset
from peerd.data.dataset import WindowDataset
from peerd.data.sampler import EpochSampler, micro_batches
from peerd.data.validation import validation_micro_batches
from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerMisbehaved
from peerd.loading import to_mapping
from peerd.log import get_logger
from peerd.pipeline import checkpoint
from peerd.pipeline.codec import RawDecoder, build_codecs
from peerd.pipeline.config import TrainConfig
from peerd.pipeline.deadlines import StepDeadline
from peerd.pipeline.frames import (
    KIND_ACT,
    KIND_GRAD,
    KIND_NORM_PART,
    KIND_NORM_TOTAL,
    KIND_VAL,
    NORM_DTYPE,
    NORM_SHAPE,
    RAW_CODEC,
    Expectation,
    TensorMessage,
    norm_expectation,
    raw_payload,
)
from peerd.pipeline.optim import (
    OVERFLOWED,
    add_partial_norms,
    build_optimizer,
    build_scheduler,
    clip_coefficient,
    seek_schedule,
    squared_norm,
)
from peerd.pipeline.partition import build_stage
from peerd.pipeline.precision import StagePrecision
from peerd.pipeline.schedule import Op, get_schedule
from peerd.pipeline.sender import StreamSender
from peerd.pipeline.streams import (
    Inbox,
    PeerRef,
    StreamReceiver,
    StreamStats,
    stage_protocol,
)
from peerd.swarm.profiling import memory_info, resolve_device
from peerd.swarm.transport import Transport

logger = get_logger(__name__)


class StageOutOfMemory(PeerdError):
    """A step ran out of device (or host) memory: this allocation does not fit this peer."""

    code = ErrorCode.INFEASIBLE


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.2f} GiB"


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def out_of_memory(exc: BaseException, device: torch.device, stage: int, step: int) -> StageOutOfMemory:
    """The typed error for an out-of-memory ``exc``, with what was requested and what is free."""
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]?i?B)", str(exc))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give back what the failed step cached, before measuring
    try:
        total, free = memory_info(device)
    except Exception:  # a broken device must not hide the out-of-memory itself
        total, free = 0, None
    requested = asked.group(1) if asked else "unknown"
    return StageOutOfMemory(
        f"out of memory on {device} in stage {stage} step {step}: requested {requested}, "
        f"free {_gib(free)} of {_gib(total)} ({type(exc).__name__})"
    )


class Reducer(Protocol):
    """Averages a stage's gradients over its replicas (``peerd.averaging.GroupAllReduce`` has this shape)."""

    any_overflowed: bool
    """After ``allreduce``: whether any replica flagged its fp16 gradients as overflowed."""

    async def allreduce(
        self, step: int, tensors: Sequence[torch.Tensor], overflowed: bool = False
    ) -> list[torch.Tensor]: ...


def _waited(reducer: Reducer) -> float:
    """Seconds ``reducer``'s steps so far waited for the slowest replica (``AveragingStats.waited_s``;
    0 for a reducer that does not count them)."""
    return float(getattr(getattr(reducer, "stats", None), "waited_s", 0.0))


@dataclass(frozen=True)
class Snapshot:
    """The trainable state as it was at the start of step ``step`` (host memory), before its update."""

    step: int
    module: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]


INLINE_COMPUTE_S = 0.004
"""A compute call (forward, backward, update, ...) whose last run took at most this long runs on
the event loop of a CPU stage: a hand-off to the compute thread and back waits twice for the GIL
and for a core, which on a busy machine costs as much as a small stage's micro-batch, while a few
milliseconds' stall of the loop only delays the streams' reads (they are buffered)."""

PHASES = ("compute", "wait", "send", "averaging_wait", "averaging", "norm", "update")
_PHASE_OF = {
    Op.FORWARD: "compute",
    Op.BACKWARD: "compute",
    Op.RECV_ACT: "wait",
    Op.RECV_GRAD: "wait",
    Op.SEND_ACT: "send",
    Op.SEND_GRAD: "send",
}


@dataclass
class StepReport:
    """What one tasklet did in one step."""

    job: str
    stage: int
    replica: int
    step: int
    loss: float | None  # this replica's mean loss (last stage only)
    examples: int  # this replica's examples
    tokens: int  # this replica's tokens
    step_s: float
    tokens_per_s: float  # the whole job's tokens (all replicas) per second of this step
    finished_at: float = 0.0  # wall clock (time.time()) when the step ended here
    val_loss: float | None = (
        None  # last stage, evaluation steps: this replica's held-out loss after the update
    )
    wire_bytes: dict[str, int] = field(default_factory=dict)  # this step, per boundary/direction/side
    phases_s: dict[str, float] = field(default_factory=dict)
    """Where ``step_s`` went (``PHASES``): forward and backward passes with their encoding (``compute``),
    waiting for and decoding neighbours' messages (``wait``), handing messages to the streams until
    the neighbours acknowledged them (``send``), gradient averaging among the replicas: the wait
    for the slowest replica to reach the step (``averaging_wait``, as the group counts it) and the
    rest of the all-reduce (``averaging``), the replica-wide gradient norm's trip along the pipeline
    that clipping needs (``norm``: it waits for every stage's averaging), and the optimizer step
    (``update``)."""
    rejected: dict[str, int] = field(default_factory=dict)  # cumulative, per error code
    resends: int = 0
    reconnects: int = 0


class StageWorker:
    """One stage replica: build with the allocation's neighbours, ``start`` (serve), ``connect``, ``run``, ``close``."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        stage: int,
        replica: int,
        replicas: int,
        transport: Transport,
        upstream: PeerRef | None,
        downstream: PeerRef | None,
        reducer: Reducer | None = None,
        dataset: WindowDataset | None = None,
        on_report: Callable[[StepReport], None] | None = None,
        epoch: int = 0,
    ) -> None:
        cfg.validate()
        self.epoch = epoch  # the allocation's: streams of a superseded one are refused (STALE)
        self.cfg = cfg
        self.stage, self.replica, self.replicas = stage, replica, replicas
        self.num_stages = cfg.num_stages
        if not 0 <= stage < self.num_stages or not 0 <= replica < replicas:
            raise ConfigError(
                "allocation", f"tasklet ({stage}, {replica}) outside {self.num_stages}x{replicas}"
            )
        self.first, self.last = stage == 0, stage == self.num_stages - 1
        if (upstream is None) != self.first or (downstream is None) != self.last:
            raise ConfigError("allocation", f"stage {stage} needs exactly its existing neighbours")
        if replicas > 1 and reducer is None:
            raise ConfigError("allocation", f"stage {stage} has {replicas} replicas but no gradient reducer")
        self.transport = transport
        self._neighbours = (upstream, downstream)
        self.reducer = reducer
        self.on_report = on_report
        self.device = resolve_device(cfg.device)  # ConfigError naming device if it is not here
        self.precision = StagePrecision(cfg.precision, self.device)
        logger.info(
            "job %s stage %d replica %d computes on %s in %s",
            cfg.job,
            stage,
            replica,
            self.device,
            cfg.precision,
        )
        self.model = cfg.model.family()  # the registry's model: layers, loss and hidden width
        self.dataset = dataset if dataset is not None else build_dataset(cfg.data)
        self.seq_len = self.dataset.seq_len
        self.module = build_stage(self.model.build_layer, self.model.num_layers, cfg.layers_per_stage, stage)
        self.module.to(self.device)  # built on the host from the seed (identical everywhere), then moved
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, cfg.steps)
        self.clip = cfg.optimizer.grad_clip
        # the norm exchange also carries fp16's overflow verdict, so every stage skips the same steps
        self.exchanges_norms = self.clip is not None or (
            self.precision.loss_scale is not None and self.num_stages > 1
        )
        self._sent_overflow = False  # fp16: an input gradient of this step overflowed (sent as zeros)
        self.overflow_skips = 0  # fp16: steps every stage skipped because some gradient overflowed
        self.sampler = EpochSampler(len(self.dataset), cfg.global_batch, cfg.data_seed, replicas)
        self.validation = cfg.data.validation
        self._val_chunks: list[list[int]] = []  # this replica's held-out micro-batches
        if self.validation is not None:
            self._val_chunks = validation_micro_batches(
                self.dataset.held_out_ids(),
                self.validation,
                global_batch=cfg.global_batch,
                micro_batch=cfg.micro_batch_size,
                replica=replica,
                replicas=replicas,
            )
        self.schedule = get_schedule(cfg.schedule)
        self.codecs = build_codecs(cfg.compression, first=self.first, last=self.last, device=self.device)
        self.step = 0  # the next step to run; written only by _apply (compute thread) and load_state
        self._snapshot: Snapshot | None = None  # rollback: the state at self.step - 1
        self._closed = False
        self.stats = StreamStats()
        self.inbox = Inbox(self.step)
        self._ids_cache: dict[int, list[list[int]]] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"peerd-s{stage}r{replica}"
        )
        self._running: concurrent.futures.Future[Any] | None = None  # the compute thread's last call
        self._compute_s: dict[
            Callable[..., Any], float
        ] = {}  # seconds each compute function's last call took
        self.inline_compute_s = INLINE_COMPUTE_S
        self.protocol = stage_protocol(cfg.job, stage)
        expectations = {KIND_ACT: self._expectation(KIND_ACT), KIND_GRAD: self._expectation(KIND_GRAD)}
        decoders: dict[str, Any] = {
            k: d
            for k, d in ((KIND_ACT, self.codecs.recv_act), (KIND_GRAD, self.codecs.recv_grad))
            if d is not None
        }
        if self._val_chunks and not self.first:  # held-out activations from above, raw float32
            expectations[KIND_VAL] = self._val_expectation
            decoders[KIND_VAL] = RawDecoder()
        if self.exchanges_norms:  # the norm exchange: partial sums from below, the total from above
            if not self.last:
                expectations[KIND_NORM_PART] = lambda step: norm_expectation(
                    cfg.job, KIND_NORM_PART, stage, step
                )
                decoders[KIND_NORM_PART] = RawDecoder()
            if not self.first:
                expectations[KIND_NORM_TOTAL] = lambda step: norm_expectation(
                    cfg.job, KIND_NORM_TOTAL, stage - 1, step
                )
                decoders[KIND_NORM_TOTAL] = RawDecoder()
        self.receiver = StreamReceiver(
            upstream=upstream,
            downstream=downstream,
            expectations=expectations,
            decoders=decoders,
            inbox=self.inbox,
            epoch=epoch,
            stats=self.stats,
            # on a device a decode may wait for it (e.g. a finiteness check): never on the event loop
            config=cfg.streams
            if self.device.type == "cpu"
            else dataclasses.replace(cfg.streams, inline_decode_bytes=0),
        )
        # how long to wait for a neighbour's message, and for it to accept ours: learnt from the steps
        self.deadline = StepDeadline(cfg.streams.recv_timeout_s, cfg.streams.deadlines)
        self.ack_deadline = StepDeadline(cfg.streams.ack_timeout_s, cfg.streams.deadlines)
        # and for the replicas' gradients (the averaging group's waits follow it where it can)
        self.averaging_deadline = StepDeadline(cfg.averaging_timeout_s, cfg.streams.deadlines)
        # GroupAllReduce follows it; in-process reducers wait for nothing
        follow = getattr(reducer, "follow_deadline", None)
        if follow is not None:
            follow(self.averaging_deadline.seconds)
        self._last_step_end: float | None = None  # perf_counter at the end of the previous step
        self._last_loss: tuple[int, float] | None = None  # (step, loss) of the last stage's newest step
        self.to_next = self._sender(downstream, stage + 1)
        self.to_prev = self._sender(upstream, stage - 1)
        self._serving = False
        self.reports: list[StepReport] = []  # every step this worker completed

    def _sender(self, peer: PeerRef | None, stage: int) -> StreamSender | None:
        if peer is None:
            return None
        return StreamSender(
            self.transport,
            peer,
            stage_protocol(self.cfg.job, stage),
            config=self.cfg.streams,
            stats=self.stats,
            on_failure=self.inbox.fail,
            epoch=self.epoch,
            ack_deadline=self.ack_deadline.seconds,
        )

    def _expectation(self, kind: str) -> Callable[[int], Expectation]:
        boundary = self.stage - 1 if kind == KIND_ACT else self.stage
        decoder = self.codecs.recv_act if kind == KIND_ACT else self.codecs.recv_grad
        codec = decoder.name if decoder is not None else "none"
        row_shape = (self.seq_len, self.model.hidden)

        def expect(step: int) -> Expectation:
            return Expectation(
                self.cfg.job, kind, boundary, codec, "float32", row_shape, (step, step + 1), self._ids_of
            )

        return expect

    def _val_expectation(self, step: int) -> Expectation:
        row_shape = (self.seq_len, self.model.hidden)
        return Expectation(
            self.cfg.job,
            KIND_VAL,
            self.stage - 1,
            RAW_CODEC,
            "float32",
            row_shape,
            (step, step + 1),
            self._val_ids_of,
        )

    def evaluates_after(self, step: int) -> bool:
        """Whether the held-out loss is evaluated once step ``step``'s update is applied."""
        return (
            bool(self._val_chunks)
            and self.validation is not None
            and self.validation.evaluates_after(step + 1, self.cfg.steps)
        )

    def _val_ids_of(self, step: int, mb: int) -> list[int] | None:
        if not self.evaluates_after(step) or not 0 <= mb < len(self._val_chunks):
            return None
        return self._val_chunks[mb]

    def _micro(self, step: int) -> list[list[int]]:
        chunks = self._ids_cache.get(step)
        if chunks is None:
            ids = self.sampler.replica_ids(step, self.replica)
            chunks = self._ids_cache[step] = micro_batches(ids, self.cfg.micro_batch_size)
            for old in [s for s in self._ids_cache if s < step - 1]:
                del self._ids_cache[old]
        return chunks

    def _ids_of(self, step: int, mb: int) -> list[int] | None:
        chunks = self._micro(step)
        return chunks[mb] if 0 <= mb < len(chunks) else None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Serve this stage's protocol: when this returns, the neighbours may connect (the ready handshake)."""
        await self.receiver.serve(self.transport, self.protocol)
        self._serving = True

    async def connect(self) -> None:
        """Open the persistent streams to both neighbours (they must have ``start``-ed)."""
        for sender in (self.to_next, self.to_prev):
            if sender is not None:
                await sender.start()
        start = getattr(self.reducer, "start", None)
        if start is not None:
            await start()

    async def close(self) -> None:
        """Release the streams, compute thread, codecs and gradient reducer; never raises (shutdown paths call it)."""
        with contextlib.suppress(Exception):
            await self._release()
        close = getattr(self.reducer, "close", None)  # connect() started it: this worker stops it
        if close is not None:
            with contextlib.suppress(Exception):
                await close()

    def unreported_loss(self) -> tuple[int, float] | None:
        """(step, loss) of a step whose update was applied but whose report never came (a cancel
        between the two); None when every applied step was reported, or off the last stage."""
        if self._last_loss is None:
            return None
        step = self._last_loss[0]
        reported = bool(self.reports) and self.reports[-1].step == step
        return self._last_loss if self.step == step + 1 and not reported else None

    @property
    def closed(self) -> bool:
        """True once ``close`` has released the compute thread (its state can no longer be read)."""
        return self._closed

    async def _release(self) -> None:
        self.inbox.hold(False)  # nothing more to checkpoint: no decode may wait for a step that never comes
        for sender in (self.to_next, self.to_prev):
            if sender is not None:
                await sender.close()
        if self._serving:
            await self.transport.stop_serving(self.protocol)
            self._serving = False
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._closed = True
        self.codecs.close()

    async def run(self, until: int | None = None) -> list[StepReport]:
        """Train from ``self.step`` up to step ``until`` (exclusive; default ``cfg.steps``), checkpointing as set."""
        end = self.cfg.steps if until is None else min(until, self.cfg.steps)
        reports = []
        every = self.cfg.checkpoint_every
        while self.step < end:
            # a step this worker checkpoints after: its AC-SGD receiver must not decode ahead
            due = (every and (self.step + 1) % every == 0) or self.step + 1 == end
            self.inbox.hold(bool(self.cfg.checkpoint_dir) and bool(due))
            reports.append(await self.train_step())
            if self.cfg.checkpoint_dir and every and self.step % every == 0:
                await self.save_checkpoint()
        for sender in (self.to_next, self.to_prev):  # the last norm message too: close does not wait for acks
            if sender is not None:
                await sender.flush()
        if self.cfg.checkpoint_dir:  # clean shutdown: the state to resume from
            await self.save_checkpoint()
        return reports

    # ------------------------------------------------------------------ one step

    async def _compute(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the compute thread, or on the event loop when it is short (see
        ``INLINE_COMPUTE_S``) and the thread is idle, so the two never touch the state at once."""
        last = self._compute_s.get(fn)  # bound methods compare equal; a fresh lambda has no history
        idle = self._running is None or self._running.done()
        if self.device.type == "cpu" and idle and last is not None and last <= self.inline_compute_s:
            started = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self._compute_s[fn] = time.perf_counter() - started
        self._running = self._executor.submit(self._timed, fn, *args)
        return await asyncio.wrap_future(self._running)

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._compute_s[fn] = time.perf_counter() - started

    async def train_step(self) -> StepReport:
        step = self.step
        try:
            report = await self._train_step(step)
        except PeerdError as exc:
            await self._abort(step, exc)
            raise
        except (RuntimeError, MemoryError) as exc:
            if not _is_oom(exc):
                await self._abort(step, PeerdError(f"{type(exc).__name__}: {exc}"))
                raise
            oom = await self._compute(out_of_memory, exc, self.device, self.stage, step)
            await self._abort(step, oom)
            raise oom from exc
        except Exception as exc:  # a bug here must still stop the neighbours, not leave them waiting
            await self._abort(step, PeerdError(f"{type(exc).__name__}: {exc}"))
            raise
        now = time.perf_counter()
        if self._last_step_end is not None:  # from the previous step's end: what a neighbour waits through
            for deadline in (self.deadline, self.ack_deadline, self.averaging_deadline):
                deadline.observe(now - self._last_step_end)
        self._last_step_end = now
        return report

    async def _train_step(self, step: int) -> StepReport:
        started = time.perf_counter()
        before = self.stats.wire_bytes()
        self.inbox.advance(step)
        chunks = self._micro(step)
        examples = sum(len(c) for c in chunks)
        actions = self.schedule.actions(self.stage, self.num_stages, len(chunks))
        timeout = self.deadline.seconds()
        inputs: dict[int, torch.Tensor] = {}  # mb -> input leaf (stages > 0)
        outputs: dict[int, torch.Tensor] = {}  # mb -> output, or weighted loss on the last stage
        out_grads: dict[int, torch.Tensor] = {}
        encoded: dict[tuple[Op, int], Any] = {}  # (SEND_ACT | SEND_GRAD, mb) -> payload
        loss_sum = 0.0
        self._sent_overflow = False
        await self._compute(self.optimizer.zero_grad, True)
        mark = time.perf_counter()
        phases = {**dict.fromkeys(PHASES, 0.0), "compute": mark - started}
        for action in actions:
            mb, op = action.mb, action.op
            ids = chunks[mb]
            if op is Op.RECV_ACT:
                inputs[mb] = await self.inbox.get(
                    KIND_ACT, step, mb, timeout
                )  # moved to the device by FORWARD
            elif op is Op.FORWARD:
                x, y, loss, payload = await self._compute(
                    self._forward, ids, inputs.get(mb), len(ids) / examples
                )
                if x is not None:
                    inputs[mb] = x  # the input leaf on the device: SEND_GRAD sends its gradient
                outputs[mb] = y
                loss_sum += loss
                encoded[(Op.SEND_ACT, mb)] = payload
            elif op is Op.SEND_ACT:
                assert self.to_next is not None
                y, payload = outputs[mb], encoded.pop((Op.SEND_ACT, mb))
                await self.to_next.send(self._message(KIND_ACT, step, mb, ids, y, payload), payload)
            elif op is Op.RECV_GRAD:
                out_grads[mb] = await self.inbox.get(KIND_GRAD, step, mb, timeout)
            elif op is Op.BACKWARD:
                y, grad = outputs.pop(mb), out_grads.pop(mb, None)
                encoded[(Op.SEND_GRAD, mb)] = await self._compute(
                    self._backward, ids, y, grad, inputs.get(mb)
                )
            elif op is Op.SEND_GRAD:
                assert self.to_prev is not None
                x, payload = inputs.pop(mb), encoded.pop((Op.SEND_GRAD, mb))
                assert x.grad is not None, "stage input got no gradient"
                await self.to_prev.send(self._message(KIND_GRAD, step, mb, ids, x.grad, payload), payload)
            now = time.perf_counter()
            phases[_PHASE_OF[op]] += now - mark
            mark = now
        for sender in (self.to_next, self.to_prev):  # everything of this step is accepted downstream
            if sender is not None:
                await sender.flush()
        now = time.perf_counter()
        phases["send"] += now - mark
        # a cancel may land after the update is applied and before the report: keep the loss
        self._last_loss = (step, loss_sum) if self.last else None
        await self._average_and_step(step, phases)  # sets self.step = step + 1
        elapsed = time.perf_counter() - started  # the training step alone: tokens/s leave evaluation out
        val_loss = await self._evaluate(step) if self.evaluates_after(step) else None
        after = self.stats.wire_bytes()
        report = StepReport(
            job=self.cfg.job,
            stage=self.stage,
            replica=self.replica,
            step=step,
            loss=loss_sum if self.last else None,
            examples=examples,
            tokens=examples * self.seq_len,
            step_s=elapsed,
            tokens_per_s=self.cfg.global_batch * self.seq_len / elapsed,
            finished_at=time.time(),
            val_loss=val_loss,
            wire_bytes={k: v - before.get(k, 0) for k, v in after.items()},
            phases_s=phases,
            rejected=dict(self.stats.rejected),
            resends=self.stats.resends,
            reconnects=self.stats.reconnects,
        )
        self.reports.append(report)
        if self.on_report is not None:
            self.on_report(report)
        return report

    async def _evaluate(self, step: int) -> float | None:
        """The forward-only held-out pass after step ``step``'s update; the replica's mean loss on the last stage."""
        timeout = self.deadline.seconds()
        examples = sum(len(c) for c in self._val_chunks)
        loss_sum = 0.0
        for mb, ids in enumerate(self._val_chunks):
            received = None if self.first else await self.inbox.get(KIND_VAL, step, mb, timeout)
            loss, payload = await self._compute(self._evaluate_micro, ids, received, len(ids) / examples)
            if self.to_next is None:
                loss_sum += loss
                continue
            msg = TensorMessage(
                kind=KIND_VAL,
                job=self.cfg.job,
                step=step,
                mb=mb,
                boundary=self.stage,
                ids=tuple(ids),
                codec=RAW_CODEC,
                shape=(len(ids), self.seq_len, self.model.hidden),
                dtype="float32",
                seq=0,  # the sender numbers it
                nbytes=memoryview(payload).nbytes,
            )
            await self.to_next.send(msg, payload)
        if self.to_next is not None:
            await self.to_next.flush()
            return None
        return loss_sum

    def _evaluate_micro(
        self, ids: list[int], received: torch.Tensor | None, weight: float
    ) -> tuple[float, memoryview | None]:
        """Compute thread: one held-out micro-batch through the stage in eval mode, no autograd:
        (its weighted loss, None) on the last stage, else (0, its output as raw float32 bytes)."""
        training = self.module.training
        self.module.eval()  # dropout off: the held-out loss is a function of the weights alone
        try:
            with torch.no_grad(), self.precision.autocast():
                if self.first:
                    x = self.dataset.inputs(ids).to(self.device, non_blocking=True)  # (b, T) token ids
                else:
                    assert received is not None
                    x = received.to(self.device, non_blocking=True)  # (b, T, C)
                y = self.module(x)
                if self.last:
                    targets = self.dataset.targets(ids).to(self.device, non_blocking=True)
                    return self.model.loss(y, targets).float().item() * weight, None
            return 0.0, raw_payload(y.float())  # (b, T, C): the wire carries float32
        finally:
            self.module.train(training)

    # Forward and backward encode what they send in the same trip to the compute thread: every
    # hop between the event loop and that thread waits for the GIL, which on busy cores costs
    # more than a small micro-batch's encode.

    def _forward(
        self, ids: list[int], received: torch.Tensor | None, weight: float
    ) -> tuple[torch.Tensor | None, torch.Tensor, float, Any]:
        """(input leaf, output, 0, encoded output) or, on the last stage, (input leaf, weighted loss,
        its value, None); the leaf is None on the first stage. Compute thread."""
        leaf = None
        if self.first:
            x = self.dataset.inputs(ids).to(self.device, non_blocking=True)  # (b, T) token ids
        else:
            assert received is not None
            # a fresh leaf on the device (a CPU stage keeps the decoded tensor itself)
            x = leaf = received.to(self.device, non_blocking=True).requires_grad_(True)
        with self.precision.autocast():
            y = self.module(x)
            if self.last:
                targets = self.dataset.targets(ids).to(self.device, non_blocking=True)
                loss = self.model.loss(y, targets)
        if not self.last:
            assert self.codecs.send_act is not None
            sent = y.detach().float()  # (b, T, C): the wire carries float32 whatever autocast computed in
            return leaf, y, 0.0, self.codecs.send_act.encode(tuple(ids), sent)
        # this micro-batch's share of the replica's mean
        return leaf, loss.float() * weight, loss.item() * weight, None

    def _backward(
        self, ids: list[int], y: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None
    ) -> Any:
        """Backward through the stage; the encoded gradient of its input ``x`` (None on the first stage)."""
        if self.last:
            self.precision.scale(y).backward()
        else:
            assert grad is not None
            y.backward(grad.to(self.device, dtype=y.dtype, non_blocking=True))
        if self.first:
            return None
        assert x is not None and x.grad is not None and self.codecs.send_grad is not None
        if self.precision.loss_scale is not None and not bool(torch.isfinite(x.grad).all()):
            # fp16 overflow: the wire takes no Inf/NaN (the neighbour would suspect this peer); the
            # step is skipped everywhere anyway, through this stage's part of the norm exchange
            self._sent_overflow = True
            x.grad.zero_()
        return self.codecs.send_grad.encode(tuple(ids), x.grad)

    def _message(
        self, kind: str, step: int, mb: int, ids: list[int], t: torch.Tensor, payload: Any
    ) -> TensorMessage:
        codec = self.codecs.send_act if kind == KIND_ACT else self.codecs.send_grad
        assert codec is not None
        return TensorMessage(
            kind=kind,
            job=self.cfg.job,
            step=step,
            mb=mb,
            boundary=self.stage if kind == KIND_ACT else self.stage - 1,
            ids=tuple(ids),
            codec=codec.name,
            shape=tuple(t.shape),
            dtype="float32",
            seq=0,  # the sender numbers it
            nbytes=memoryview(payload).nbytes,
        )

    async def _average_and_step(self, step: int, phases: dict[str, float]) -> None:
        """Average, exchange the norm and update; adds each part's seconds to ``phases``."""
        mark = time.perf_counter()
        grads, finite = await self._compute(self._local_grads)
        overflowed = not finite
        waited = 0.0
        if self.reducer is not None:  # the averaging group works on host tensors
            before = _waited(self.reducer)
            # fp16: an overflow anywhere among the replicas is every replica's (the group carries the flag)
            grads = await self.reducer.allreduce(step, grads, overflowed)
            overflowed = self.reducer.any_overflowed
            waited = _waited(self.reducer) - before
        now = time.perf_counter()
        waited = min(max(waited, 0.0), now - mark)
        phases["averaging_wait"] += waited
        phases["averaging"] += now - mark - waited
        mark = now
        scale = 1.0
        if self.exchanges_norms:
            total = await self._replica_squared_norm(step, grads, overflowed)
            overflowed = total == OVERFLOWED
            if self.clip is not None and not overflowed:
                scale = clip_coefficient(total, self.clip)
            now = time.perf_counter()
            phases["norm"] += now - mark
            mark = now
        if overflowed:
            self.overflow_skips += 1
            logger.info(
                "job %s stage %d: step %d skipped, fp16 gradients overflowed (loss scale %g)",
                self.cfg.job, self.stage, step, self.precision.loss_scale.value if self.precision.loss_scale else 0,
            )  # fmt: skip
        await self._compute(self._apply, step, grads, scale, overflowed)
        phases["update"] += time.perf_counter() - mark

    async def _replica_squared_norm(self, step: int, grads: list[torch.Tensor], overflowed: bool) -> float:
        """The sum of squares of the whole replica's gradients: partial sums go up, stage 0's total comes down.

        Every stage uses stage 0's one float64, so all stages (and replicas: their averaged
        gradients are identical) scale by the same coefficient. Under fp16 a stage whose
        gradients overflowed sends ``OVERFLOWED`` instead, which absorbs every sum: then every
        stage skips the step.
        """
        timeout = self.deadline.seconds()
        partial = OVERFLOWED if overflowed else await self._compute(squared_norm, grads)
        if not self.last:  # stages below, summed by the next stage
            below = self._received_norm(
                await self.inbox.get(KIND_NORM_PART, step, 0, timeout), step, self._neighbours[1]
            )
            partial = add_partial_norms(partial, below)
        if self.first:
            total = partial
        else:
            assert self.to_prev is not None
            await self._send_norm(self.to_prev, KIND_NORM_PART, step, self.stage - 1, partial)
            total = self._received_norm(
                await self.inbox.get(KIND_NORM_TOTAL, step, 0, timeout), step, self._neighbours[0]
            )
        if not self.last:
            assert self.to_next is not None
            await self._send_norm(self.to_next, KIND_NORM_TOTAL, step, self.stage, total)
        return total

    async def _send_norm(
        self, sender: StreamSender, kind: str, step: int, boundary: int, value: float
    ) -> None:
        payload = raw_payload(torch.tensor([value], dtype=torch.float64))
        msg = TensorMessage(
            kind=kind,
            job=self.cfg.job,
            step=step,
            mb=0,
            boundary=boundary,
            ids=(),
            codec=RAW_CODEC,
            shape=NORM_SHAPE,
            dtype=NORM_DTYPE,
            seq=0,  # the sender numbers it
            nbytes=memoryview(payload).nbytes,
        )
        # not flushed here: waiting for its ack would hold this stage's update (and stage 0's next
        # forward) a round trip; the next step's flush, or the end of ``run``, waits for it
        await sender.send(msg, payload)

    def _received_norm(self, value: torch.Tensor, step: int, sender: PeerRef | None) -> float:
        """A neighbour's sum of squares; ``OVERFLOWED`` only where this job scales its loss (fp16)."""
        norm = float(value)
        if norm < 0 and (norm != OVERFLOWED or self.precision.loss_scale is None):
            raise PeerMisbehaved(
                f"norm frame of step {step} from {sender} holds {norm}: a sum of squares"
                + (f", or {OVERFLOWED} for an fp16 overflow" if self.precision.loss_scale else ""),
                peer=str(sender),
                code=ErrorCode.OUT_OF_RANGE,
            )
        return norm

    def _local_grads(self) -> tuple[list[torch.Tensor], bool]:
        """This replica's (unscaled) gradients: on the device, or host copies when a reducer averages
        them; and whether they (and, under fp16, the input gradients this stage sent) are finite. Compute thread."""
        # fp16: unscaled before the norm and the update
        finite = self.precision.unscale(self.params) and not self._sent_overflow
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if not finite and self.reducer is not None:
            for g in grads:  # the averaging wire takes no Inf/NaN: the flag says it, the step is skipped
                g.zero_()
        if self.reducer is None or self.device.type == "cpu":
            return grads, finite
        return [to_host(g) for g in grads], finite

    def _apply(
        self, step: int, grads: list[torch.Tensor], scale: float = 1.0, overflowed: bool = False
    ) -> None:
        """Compute thread: the whole update of ``step``, so a cancelled await never splits it.

        A cancelled caller stops waiting but this call still runs to its end (or, if it had
        not started, not at all): ``self.step`` and the state agree either way.
        """
        assert self.step == step, f"update of step {step} applied at step {self.step}"
        if self.cfg.rollback:
            self._snapshot = take_snapshot(step, self.module, self.optimizer, self.scheduler)
        for p, g in zip(self.params, grads, strict=True):
            # averaged on the host: back onto the device (a blocking copy: the averaging group may
            # reuse its host buffers as soon as this returns)
            g = g.to(self.device)
            p.grad = g if scale == 1.0 else g.mul_(scale)  # clip_grad_norm_'s scaling, across stages
        self.precision.step(self.optimizer, overflowed)  # fp16: skipped when some gradient overflowed
        self.precision.step_schedule(self.scheduler)  # the lr of step + 1
        self.step = step + 1

    async def quiesce(self) -> None:
        """Return once the compute thread has finished what it was running (e.g. after a cancel).

        From then on ``self.step`` and the module/optimizer state agree, until the next
        ``run``/``train_step``. Work queued but not started by a cancelled step is dropped.
        """
        if self._closed:
            return  # close() waited for the thread
        await asyncio.wrap_future(self._executor.submit(lambda: None))  # FIFO: after all before it

    async def tell_neighbours_stopped(self, reason: str) -> None:
        """Best effort, after a cancel: tell both neighbours this stage gave up on its current step.

        A stopped tasklet (a re-plan, a leave, a shutdown) closes its streams, and a closed stream
        alone does not tell a neighbour waiting for this stage's next message that it will never come.
        """
        for sender in (self.to_next, self.to_prev):
            if sender is not None:
                await sender.abort(
                    self.step, ErrorCode.PEER_UNAVAILABLE, f"stage {self.stage} stopped: {reason}"
                )

    async def _abort(self, step: int, exc: PeerdError) -> None:
        logger.warning("stage %d replica %d: step %d failed: %s", self.stage, self.replica, step, exc)
        self.inbox.fail(exc)
        for sender in (self.to_next, self.to_prev):
            if sender is not None:
                await sender.abort(step, exc.code, exc.message)

    # ------------------------------------------------------------------ checkpoints

    def _dir(self) -> Any:
        assert self.cfg.checkpoint_dir is not None
        return checkpoint.tasklet_dir(self.cfg.checkpoint_dir, self.cfg.job, self.stage, self.replica)

    def state_dict(self) -> dict[str, Any]:
        """The live state at ``self.step`` (checkpoint format, host tensors); between steps or after ``quiesce``.

        On the CPU the tensors are the live ones (no copy); on a device, host copies.
        """
        state_of = getattr(self.reducer, "state_dict", None)
        state = self._state(
            self.step,
            host_copy(self.module.state_dict()),
            host_copy(self.optimizer.state_dict()),
            self.scheduler.state_dict(),
            codecs=self.codecs.state_dict(),  # AC-SGD buffers of both boundary sides
            averaging=host_copy(state_of()) if state_of is not None else None,
        )
        if self.precision.loss_scale is not None:
            state["scaler"] = self.precision.state_dict()  # fp16's loss scale and its growth tracker
        return state

    def _state(
        self,
        step: int,
        module: dict[str, Any],
        optimizer: dict[str, Any],
        scheduler: dict[str, Any],
        *,
        codecs: dict[str, Any] | None,
        averaging: dict[str, Any] | None,
    ) -> dict[str, Any]:
        epoch, batch = self.sampler.position(step)
        return {
            "format": checkpoint.FORMAT,
            "job": self.cfg.job,
            "stage": self.stage,
            "replica": self.replica,
            "step": step,
            "module": module,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "data": {
                "epoch": epoch,
                "batch": batch,
                "digest": self.dataset.digest,
                "seed": self.cfg.data_seed,
                "replicas": self.replicas,
                "global_batch": self.cfg.global_batch,
            },
            "averaging": averaging,
            "codecs": codecs,
            "meta": {
                "layers": [self.module.spec.start, self.module.spec.end],
                "codec_buffers": self.codecs.buffers() if codecs is not None else {},
                "compression": to_mapping(self.cfg.compression),
                "saved_at": time.time(),
            },
        }

    def available_steps(self) -> tuple[int, ...]:
        """Steps ``state_at`` can give: ``(step,)``, or ``(step - 1, step)`` with a rollback snapshot."""
        snap = self._snapshot
        if snap is not None and snap.step == self.step - 1:
            return (snap.step, self.step)
        return (self.step,)

    def state_at(self, step: int) -> dict[str, Any]:
        """The full state at ``step`` (``state_dict`` format) for a peer or a rollback; after ``quiesce``.

        For the rollback step (``self.step - 1``) ``codecs`` and ``averaging`` are None: AC-SGD
        buffers and error-feedback residuals are not kept for it, a loader starts them empty.
        """
        if step == self.step:
            return self.state_dict()
        snap = self._snapshot
        if snap is None or snap.step != step or step != self.step - 1:
            raise ConfigError(
                "step", f"state of step {step} is not kept here (have {self.available_steps()})"
            )
        return self._state(step, snap.module, snap.optimizer, snap.scheduler, codecs=None, averaging=None)

    async def held_states(self) -> dict[int, dict[str, Any]]:
        """``state_at`` of every step in ``available_steps``, built in the compute thread (a device
        worker's host copies must not wait on the device on the event loop); after ``quiesce``."""
        return await self._compute(lambda: {step: self.state_at(step) for step in self.available_steps()})

    def load_state(self, state: dict[str, Any]) -> int:
        """Take ``state`` (a checkpoint, or ``state_at`` of any replica of this stage); returns the next step.

        Refuses (ConfigError naming the field) a state of another job, stage, layer range,
        dataset, data seed or global batch; its replica index and replica count may differ. A
        state without ``codecs`` leaves the AC-SGD buffers empty; error-feedback residuals are
        taken only from this very tasklet's own state (another replica's belong to its shard).
        """
        self._check_state(state)
        self.module.load_state_dict(state["module"])  # copies host tensors onto this worker's device
        # optimizer.load_state_dict moves the moments onto the parameters' device and keeps the
        # given tensors when dtype and device match: copy, so two workers (or a worker and its
        # snapshot) never share moment buffers
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.precision.load_state_dict(state.get("scaler"))
        step = int(state["step"])
        if state.get("scheduler") is not None:
            self.scheduler.load_state_dict(copy.deepcopy(state["scheduler"]))  # it pops keys
        else:  # a checkpoint from before schedules: the lr follows from the step
            seek_schedule(self.scheduler, step)
        codecs = state.get("codecs")
        if codecs is None:
            self.reset_codecs()
        else:
            self.codecs.load_state_dict(codecs)
        load_avg = getattr(self.reducer, "load_state_dict", None)
        same_tasklet = state["replica"] == self.replica and state["data"].get("replicas") == self.replicas
        if state.get("averaging") is not None and load_avg is not None and same_tasklet:
            load_avg(state["averaging"])
        self.step = step
        self._snapshot = None
        self.inbox.advance(self.step)
        logger.info(
            "stage %d replica %d resumes at step %d (state of replica %s)",
            self.stage,
            self.replica,
            self.step,
            state["replica"],
        )
        return self.step

    def _check_state(self, state: dict[str, Any]) -> None:
        missing = [k for k in checkpoint.REQUIRED if k not in state]
        if missing:
            raise ConfigError(f"state.{missing[0]}", "missing: not a peerd stage state")
        if state["format"] != checkpoint.FORMAT:
            raise ConfigError("state.format", f"{state['format']!r}, this peerd reads {checkpoint.FORMAT}")
        data, meta = state["data"], state["meta"]
        expected: dict[str, tuple[Any, Any]] = {
            "job": (state["job"], self.cfg.job),
            "stage": (state["stage"], self.stage),
            "meta.layers": (list(meta.get("layers") or ()), [self.module.spec.start, self.module.spec.end]),
            "data.digest": (data.get("digest"), self.dataset.digest),
            "data.seed": (data.get("seed"), self.cfg.data_seed),
            "data.global_batch": (data.get("global_batch"), self.cfg.global_batch),
        }
        for key, (got, want) in expected.items():
            if got != want:
                raise ConfigError(f"state.{key}", f"{got!r} differs from this run's {want!r}")

    def reset_codecs(self) -> None:
        """Empty the AC-SGD buffers of both boundary sides (a re-plan starts every boundary empty on
        both ends, so sender and receiver stay bit-identical); call between steps."""
        self.codecs.load_state_dict({})

    async def save_checkpoint(self) -> None:
        """Atomically save this tasklet's state (in the compute thread: no step is running).

        Between steps of ``run`` the AC-SGD buffers saved here match the neighbours' saved at
        the same step bit for bit (``run`` holds the receiver's decoding of the next step).
        """
        await self._compute(
            lambda: checkpoint.save(
                self._dir(), self.state_dict(), self.cfg.keep_checkpoints, self.cfg.retain_checkpoints_s
            )
        )

    def restore(self, step: int | None = None) -> int:
        """Load the checkpoint of ``step`` (default: newest) before ``start``; returns the step to run next.

        AC-SGD buffers are restored too (both sides of a boundary saved them at the same step,
        so they resume bit-identical and examples keep travelling as deltas); a checkpoint
        without them (an older one) starts both sides empty.
        """
        return self.load_state(checkpoint.load(self._dir(), step))


def take_snapshot(
    step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> Snapshot:
    """The trainable state before step ``step``'s update, copied to host memory (rollback)."""
    return Snapshot(
        step,
        _host_copy(module.state_dict()),
        _host_copy(optimizer.state_dict()),
        copy.deepcopy(scheduler.state_dict()),
    )


def _host_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to host memory (nested dicts, lists, tuples; the rest as is)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_host_copy(v) for v in obj)
    return obj
