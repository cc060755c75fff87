"""The job runner: this peer's part in one job across commits — run its tasklet, keep its stage's state, serve it.

``TaskletRunner`` composes the pipeline and averaging layers for one peer and one job. On
each committed allocation (``adopt``) the job spec and the allocation become a
``TrainConfig`` (layers per stage from the allocation, compression from the spec), the
allocation names the upstream and downstream neighbours and the stage's replica group
(``GroupAllReduce`` in allocation order), and a ``StageWorker`` trains on the daemon's
transport until the job's last step, checkpointing every ``checkpoint_interval`` steps.

Churn. A step that breaks (a partner vanished, a stream or the averaging failed) turns the
tasklet ``recovering``: it names the partners it suspects, keeps its stage's state (the
live step and, with the worker's rollback snapshot, the step before) and waits for the
re-plan the manager starts (``peerd.jobs.health``). ``freeze`` stops a running tasklet the
same way; ``held`` is what the re-plan's roster entry declares. A commit of the re-plan
epoch is adopted like the first: every tasklet resumes from the committed roster's resume
step (``peerd.jobs.recovery``), taking its stage's state from its own memory, its own
checkpoint, or a holder over the p2p state-sync protocol (``peerd.pipeline.statesync``,
served here for the whole job), with every AC-SGD boundary reset on both sides.

Checkpoints outlive their stage: for every stage, ``checkpoint_replicas`` peers of the
allocation outside it (spares included; ranked by a hash of job, stage and peer, so every
peer agrees) pull each new checkpoint of that stage into their ``CheckpointReplicas`` store
and declare it in ``held``. When every peer of a stage is gone, the job resumes from the
newest checkpoint some member still holds for every stage. A peer that leaves applies to no
roster, so the state it stopped at reaches the next epoch only through such copies: before a
re-plan reads ``held``, ``freeze`` brings them up to date, taking the exact step a stopped
stage holds (the poll can be seconds behind, and a stage of one replica has no other copy).

Progress (step, loss history, tokens/s, bytes on the wire by kind and what they would have
been uncompressed, suspects) goes to ``progress_key(job)`` under this peer's subkey every
``interval`` seconds, also while a step runs: that heartbeat is how the other peers tell a
slow tasklet from a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peerd.averaging import GroupAllReduce
from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerUnavailable
from peerd.jobs.catalog import read_progress
from peerd.jobs.heartbeat import ProgressPublisher
from peerd.jobs.optimizer import optimizer_config
from peerd.jobs.records import (
    MAX_SUSPECTS,
    MAX_VAL_POINTS,
    JobRecord,
    Progress,
    TaskState,
    downsample,
)
from peerd.jobs.recovery import (
    CHECKPOINT_REPLICAS,
    held_state,
    holders,
    replica_peers,
    resume_step,
    stage_layers,
)
from peerd.jobs.spec import JobSpec
from peerd.jobs.store import RecordStore
from peerd.log import get_logger
from peerd.pipeline import checkpoint
from peerd.pipeline.codec import CompressionConfig
from peerd.pipeline.config import ModelBuild, TrainConfig
from peerd.pipeline.partition import balanced_layers_per_stage
from peerd.pipeline.replicas import CheckpointReplicas, replicate
from peerd.pipeline.statesync import (
    StateServer,
    StateSyncConfig,
    fetch_state,
    pack_state,
    unpack_state,
)
from peerd.pipeline.streams import StreamConfig
from peerd.pipeline.worker import StageOutOfMemory, StageWorker, StepReport
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.actions import Commit
from peerd.sched.consensus.messages import HeldState, RosterEntry
from peerd.swarm.bans import BanEvent
from peerd.swarm.transport import Transport
from peerd.tasks import cancel_and_wait

logger = get_logger(__name__)

READY_POLL_S = 0.5
REPLICATE_POLL_S = 2.0  # how often a replica peer looks for a newer checkpoint of its stages
REPLAN_COPY_S = 30.0
"""The longest a re-plan waits for this peer's copies of its stages' newest state; never over half
the roster window, so the copies cannot make this peer's roster entry miss the epoch."""
RETAIN_CHECKPOINTS_S = 60.0
"""A stage keeps every checkpoint this young. When a whole stage dies, the job resumes from the
newest copy of its checkpoint, which lags behind its own (a poll, a progress record, a
transfer): the other stages must still hold their checkpoint of that step to roll back to it."""
_FORWARD = {"acsgd": "acsgd", "direct": "quant", "none": "none"}


def tasklet_of(allocation: Allocation, peer: str) -> tuple[int, int] | None:
    """(stage, replica) that ``peer`` runs in ``allocation``, or None (a spare or not allocated)."""
    for s, stage in enumerate(allocation.stages):
        if peer in stage:
            return s, stage.index(peer)
    return None


def state_bound(spec: JobSpec) -> int:
    """Most bytes one stage's state may take on the wire: the whole model's fp32 weights and two moments, plus headroom."""
    params = sum(c.params for c in spec.model.family().layer_costs(spec.data.seq_len))
    return int(4 * 4 * params) + (16 << 20)


def unsupported(spec: JobSpec) -> tuple[list[ConfigError], list[str]]:
    """(errors, warnings) for running ``spec`` with the pipeline worker as it is today.

    Nothing today: every model family runs, ``finetune`` loads ``init_checkpoint`` on each stage
    (``peerd.models.registry.with_weights``) and the optimizer section runs as written
    (``peerd.pipeline.optim``), so nothing in the spec is ignored or warned about.
    """
    errors: list[ConfigError] = []
    return errors, []


def train_config(
    job_id: str,
    spec: JobSpec,
    allocation: Allocation,
    checkpoint_root: Path | None,
    device: str = "auto",
) -> TrainConfig:
    """The pipeline configuration every tasklet of ``allocation`` runs with (identical on every peer
    but for ``device``, this daemon's ``--device``)."""
    num_layers = spec.model.family().num_layers
    layers = list(allocation.layers) if allocation.layers is not None else None
    if layers is None or sum(layers) != num_layers:
        layers = balanced_layers_per_stage(num_layers, allocation.d_pp)
    comp = spec.compression
    compression = CompressionConfig(
        forward=_FORWARD[comp.forward],  # type: ignore[arg-type]
        forward_bits=comp.forward_bits or 4,
        backward="quant" if comp.backward_bits else "none",
        backward_bits=comp.backward_bits or 8,
        gradients="quant" if comp.gradient_bits else "none",
        gradient_bits=comp.gradient_bits or 8,
        seed_codec=comp.first_visit_codec or "fp32",  # fp32 only where nothing is sent as a first visit
    )
    hf = spec.model.hf if isinstance(spec.model.hf, dict) else None  # a path is inlined at submit
    model = ModelBuild(
        preset=spec.model.preset or "tiny",
        overrides=dict(spec.model.overrides),
        hf=hf,
        seed=spec.model.seed,
        init_checkpoint=spec.init_checkpoint,  # opened by each tasklet's worker (its own disk)
    )
    return TrainConfig(
        job=job_id,
        model=model,
        data=spec.data,
        layers_per_stage=layers,
        global_batch=spec.global_batch,
        micro_batch_size=spec.micro_batch,
        steps=spec.steps,
        optimizer=optimizer_config(spec.optimizer),
        compression=compression,
        # neighbours start when they see the commit, seconds apart: generous connect deadlines
        streams=StreamConfig(connect_timeout_s=90.0, recv_timeout_s=180.0, ack_timeout_s=180.0),
        averaging_timeout_s=180.0,
        checkpoint_dir=str(checkpoint_root) if checkpoint_root is not None else None,
        checkpoint_every=spec.checkpoint_interval,
        retain_checkpoints_s=RETAIN_CHECKPOINTS_S,
        rollback=True,  # a re-plan may resume one step back: keep the state before each update
        device=device,
        precision=spec.precision,
    )


def carried_losses(
    own: Sequence[tuple[int, float]],
    history: Sequence[tuple[int, float]],
    resume: int,
    shared_steps: set[int],
) -> list[tuple[int, float]]:
    """The loss points before ``resume`` that a last-stage tasklet's record carries into a new epoch.

    ``history`` is the job's curve as the daemon saw it (the mean over the replicas of the
    time): its values win. This tasklet's own losses fill the steps it lacks, but only those
    it trained as the stage's only replica: beside other replicas its loss was one share of
    the mean, and in the new epoch's record it would stand for the whole job's.
    """
    mine = {s: loss for s, loss in own if s < resume and s not in shared_steps}
    job = {s: loss for s, loss in history if s < resume}
    return sorted({**mine, **job}.items())


@dataclass
class _Frozen:
    """A stopped tasklet's stage state, by step (what ``held`` declares and the state server serves)."""

    stage: int
    layers: tuple[int, int]
    states: dict[int, dict[str, Any]]


class TaskletRunner:
    """This peer's part in one job: ``start``, ``adopt`` each commit, ``freeze`` on a failure, ``close``."""

    def __init__(
        self,
        job: JobRecord,
        spec: JobSpec,
        *,
        store: RecordStore,
        transport: Transport,
        peer_ref: Callable[[str], Any],
        checkpoint_root: Path | None,
        interval: float = 2.0,
        ready_timeout: float = 120.0,
        statesync: StateSyncConfig | None = None,
        replicas: CheckpointReplicas | None = None,
        checkpoint_replicas: int = CHECKPOINT_REPLICAS,
        device: str = "auto",
    ) -> None:
        self.job, self.spec, self.store = job, spec, store
        self.transport, self.peer_ref, self.interval = transport, peer_ref, interval
        self.checkpoint_root = checkpoint_root
        self.ready_timeout = ready_timeout
        self.statesync = statesync or StateSyncConfig()
        self.replicas = replicas
        self.checkpoint_replicas = checkpoint_replicas
        self.device = device  # where this peer's tasklets compute (the daemon's --device)
        self.commit: Commit | None = None
        self.stage: int | None = None  # this peer's tasklet in ``commit`` (None: a spare)
        self.replica: int | None = None
        self.cfg: TrainConfig | None = None
        self.unfit: str | None = None  # why this peer must not run a tasklet of this job again
        self.state = TaskState.RUNNING
        self.reason = ""
        self.suspects: tuple[str, ...] = ()
        self.step = 0
        self.losses: list[tuple[int, float]] = []
        self._shared_steps: set[int] = set()  # steps of self.losses trained beside other replicas
        self.val_losses: list[tuple[int, float]] = []  # (steps completed, held-out loss)
        self.tokens_per_s = 0.0
        self.wire: dict[str, int] = {}
        self._phase_sums: dict[str, float] = {}  # seconds per phase over the steps counted (``phases``)
        self._phase_steps = 0
        self._step_end: float | None = None  # when the current worker's last step ended (perf_counter)
        self._steady_s = 0.0  # wall seconds between consecutive step ends of one worker (``s_per_step``)
        self.started_at = store.now()
        self.worker: StageWorker | None = None
        self.recoveries: list[dict[str, Any]] = []  # per adopted commit: where the state came from, how long
        self.server = StateServer(transport, job.job_id, self.provide, config=self.statesync)
        self._frozen: _Frozen | None = None
        self.retired = False
        self._task: asyncio.Task | None = None
        self.heartbeat = ProgressPublisher(
            store, job.job_id, self.progress, interval=interval, paced=lambda: self.state == TaskState.RUNNING
        )
        self._replicator: asyncio.Task | None = None
        self._copying = asyncio.Lock()  # the poll and a re-plan's copy pass take turns
        self._lock = asyncio.Lock()
        self.banned: dict[str, BanEvent] = {}  # partners this peer's transport banned (their latest ban)
        self._unsubscribe: Callable[[], None] | None = None
        self._wire_before: dict[str, int] = {}  # bytes sent by the workers of earlier commits
        self._group: GroupAllReduce | None = None

    @property
    def me(self) -> str:
        return self.store.me

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Serve this job's state-sync protocol (peers may fetch the stage state held here)."""
        await self.server.start()
        self._unsubscribe = self.transport.banlist.subscribe(self._on_ban)
        self.heartbeat.start()
        if self.replicas is not None and self.checkpoint_root is not None and self.spec.checkpoint_interval:
            self._replicator = asyncio.create_task(self._replicate_loop())

    async def close(self) -> None:
        """Stop the tasklet, publish its last record, stop serving; never raises (shutdown paths call it)."""
        if not self.retired:  # a finished job's record stays as it ended
            async with self._lock:
                with contextlib.suppress(Exception):
                    await self._stop_tasklet("its daemon shut down", TaskState.LEFT)
        await self._stop_loops()
        if self._unsubscribe is not None:
            self._unsubscribe()
        with contextlib.suppress(Exception):
            await self.server.close()

    async def retire(self) -> None:
        """The job ended: stop the tasklet and the background loops, keep serving the checkpoints held here.

        Idempotent (the manager calls it every round of a finished job); ``close`` ends the serving too.
        """
        if self.retired:
            return
        self.retired = True
        async with self._lock:
            if self.running:
                await self._stop_tasklet("the job ended", TaskState.DONE)
            self._frozen = None  # memory back: what is served now comes from the files
        await self._stop_loops()

    async def _stop_loops(self) -> None:
        await self.heartbeat.stop(final=False)
        task, self._replicator = self._replicator, None
        await cancel_and_wait(task)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # ------------------------------------------------------------------ churn API

    def held(self) -> tuple[HeldState, ...]:
        """The stage state this peer can serve: the stopped tasklet's steps and its checkpoints on disk."""
        found: dict[tuple[int, tuple[int, int]], set[int]] = {}
        frozen = self._frozen
        if frozen is not None:
            found.setdefault((frozen.stage, frozen.layers), set()).update(frozen.states)
        if self.checkpoint_root is not None and self.cfg is not None:
            for stage, span in enumerate(stage_layers(self.cfg.layers_per_stage)):
                steps = self._checkpoint_steps(stage)
                if self.replicas is not None:
                    steps |= set(self.replicas.steps(self.job.job_id, stage))
                if steps:
                    found.setdefault((stage, span), set()).update(steps)
        return tuple(held_state(stage, span, steps) for (stage, span), steps in sorted(found.items()))

    async def freeze(self, reason: str) -> None:
        """Stop a running tasklet where it is and keep its state for the re-plan; bring this peer's
        checkpoint copies up to date first, so ``held`` carries a leaving peer's last state."""
        async with self._lock:
            if self.running:
                await self._stop_tasklet(reason, TaskState.RECOVERING)
        if self._replicator is None:
            return
        limit = min(REPLAN_COPY_S, self.spec.planning.timing().roster_s / 2)
        try:
            await asyncio.wait_for(self._replicate_once(exact=True), limit)
        except TimeoutError:
            logger.warning(
                "job %s: copies for the re-plan took over %.1f s; planning without", self.job.job_id, limit
            )
        except Exception:  # the re-plan goes on with what this peer holds
            logger.exception("job %s: copying checkpoints for the re-plan failed", self.job.job_id)

    async def leave(self, reason: str) -> None:
        """Hand the tasklet over: stop it, publish ``left`` (the others re-plan without this peer), keep serving state."""
        async with self._lock:
            await self._stop_tasklet(reason, TaskState.LEFT)
            if self.state not in (TaskState.DONE, TaskState.FAILED):
                self.state, self.reason = TaskState.LEFT, reason[:200]
            with contextlib.suppress(PeerdError):
                await self.heartbeat.publish()

    async def adopt(
        self,
        commit: Commit,
        roster: list[RosterEntry] | None,
        history: Sequence[tuple[int, float]] = (),
    ) -> None:
        """Run this peer's tasklet of ``commit`` (a spare runs none), resuming at the roster's common step.

        ``history``: the job's loss curve as this peer's daemon has seen it; a last-stage tasklet
        carries its steps before the resume step in its record (it may be the only record left).
        """
        async with self._lock:
            if self.commit is not None and commit.epoch <= self.commit.epoch:
                return
            started = time.monotonic()
            reached = self.step  # steps this peer's tasklet had completed before the re-plan
            if self.running:
                await self._stop_tasklet(
                    f"superseded by the allocation of epoch {commit.epoch}", TaskState.RECOVERING
                )
            first = self.commit is None
            self.commit = commit
            # a new epoch forgets the partners whose bans are over (a ban in this epoch stays)
            self.banned = {
                p: e for p, e in self.banned.items() if self.transport.banlist.remaining(e.peer) > 0
            }
            where = tasklet_of(commit.allocation, self.me)
            self.cfg = train_config(
                self.job.job_id, self.spec, commit.allocation, self.checkpoint_root, device=self.device
            )
            if where is None:
                self.stage = self.replica = None
                logger.info("job %s: this peer is a spare in epoch %d", self.job.job_id, commit.epoch)
                return
            if (self.stage, self.replica) != where:
                self.losses, self.val_losses = [], []  # another replica's shard: its losses are not ours
                self._shared_steps = set()
            self.stage, self.replica = where
            spans = stage_layers(self.cfg.layers_per_stage)
            resume = resume_step(roster or [], spans)
            self.state, self.reason, self.suspects = TaskState.RECOVERING, "loading state", ()
            self.step = resume
            if self.stage == commit.allocation.d_pp - 1:
                self.losses = carried_losses(self.losses, history, resume, self._shared_steps)
            else:
                self.losses = [(s, loss) for s, loss in self.losses if s < resume]
            self.val_losses = [(k, loss) for k, loss in self.val_losses if k <= resume]
            try:
                worker = await asyncio.get_running_loop().run_in_executor(None, self._build_worker)
                source = await self._load(worker, spans[self.stage], resume, roster or [])
            except (
                ConfigError
            ) as exc:  # the job cannot run here (e.g. init_checkpoint unreadable): say which field
                self.state, self.reason = TaskState.FAILED, str(exc)[:200]
                logger.warning(
                    "job %s: tasklet s%sr%s cannot start: %s", self.job.job_id, self.stage, self.replica, exc
                )
                self.heartbeat.poke()
                return
            except PeerdError as exc:
                self._recovering(f"could not take the state of stage {self.stage} at step {resume}: {exc}")
                self.suspects = tuple(
                    p
                    for p in holders(roster or [], self.stage, spans[self.stage], resume, job=self.job.job_id)
                    if p != self.me
                )[:MAX_SUSPECTS]
                self.heartbeat.poke()
                return
            self.worker = worker
            self.recoveries.append(
                {
                    "epoch": commit.epoch,
                    "resume_step": resume,
                    "steps_redone": max(0, reached - resume) if not first else 0,  # this tasklet's rollback
                    "source": source,
                    "seconds": round(time.monotonic() - started, 3),
                }
            )
            if not first:
                logger.info(
                    "job %s: tasklet s%dr%d resumes at step %d (state: %s)",
                    self.job.job_id,
                    self.stage,
                    self.replica,
                    resume,
                    source,
                )
            self._task = asyncio.create_task(self._run_tasklet(worker))

    # ------------------------------------------------------------------ the tasklet

    async def _run_tasklet(self, worker: StageWorker) -> None:
        assert self.commit is not None
        logger.info(
            "job %s: running tasklet stage %s replica %s of %dx%d (layers %s) from step %d",
            self.job.job_id,
            self.stage,
            self.replica,
            self.commit.allocation.d_pp,
            self.commit.allocation.d_dp,
            worker.cfg.layers_per_stage,
            worker.step,
        )
        try:
            if worker.step < worker.cfg.steps:
                await worker.start()  # serve the stage protocol ...
                if self._group is not None:
                    await self._group.start()  # ... and the replica group's
                self.state, self.reason = TaskState.RUNNING, ""
                await self.heartbeat.publish()  # "this tasklet serves" for this epoch (the ready handshake)
                await self._wait_ready()
                await worker.connect()
            # else: a re-plan as the job finished resumed at its last step; nothing to train, so
            # no partner to wait for (one that finished first has closed its streams already)
            await worker.run()  # at the last step: only the final checkpoint
            self.state = TaskState.DONE
            logger.info(
                "job %s: tasklet s%sr%s finished %d steps",
                self.job.job_id,
                self.stage,
                self.replica,
                self.step,
            )
        except asyncio.CancelledError:
            raise
        except StageOutOfMemory as exc:
            # too big for this device as it is now: hand the tasklet over like a leave (its state
            # at the last finished step stays served) and apply for no re-plan of this job
            self.state, self.reason = TaskState.LEFT, f"handed over: {exc}"[:200]
            self.unfit = str(exc)
            logger.warning(
                "job %s: tasklet s%sr%s handed over: %s", self.job.job_id, self.stage, self.replica, exc
            )
        except ConfigError as exc:  # this peer cannot run it: the reason says why
            self.state, self.reason = TaskState.FAILED, str(exc)[:200]
            logger.warning(
                "job %s: tasklet s%sr%s failed: %s", self.job.job_id, self.stage, self.replica, exc
            )
        except PeerdError as exc:
            self._recovering(str(exc))
            partners = self._partners()
            culprit = getattr(exc, "peer", None)  # PeerMisbehaved: a partner sent NaN/absurd values
            banned = tuple(sorted(p for p in partners if p in self.banned))  # banned in this epoch
            self.suspects = ((culprit,) if culprit in partners else banned or tuple(sorted(partners)))[
                :MAX_SUSPECTS
            ]
            logger.warning(
                "job %s: tasklet s%sr%s stopped at step %d, waiting for a re-plan: %s",
                self.job.job_id,
                self.stage,
                self.replica,
                worker.step,
                exc,
            )
        except OSError as exc:  # this machine's disk or sockets, not a partner and not a bug: re-plan
            self._recovering(f"{type(exc).__name__} on this peer: {exc}")
            self.suspects = ()  # no partner to blame; the health check re-plans a stuck tasklet
            with contextlib.suppress(PeerdError):  # else they wait out their receive timeouts
                await worker.tell_neighbours_stopped(self.reason)
            logger.warning(
                "job %s: tasklet s%sr%s stopped at step %d by a local error, waiting for a re-plan: %r",
                self.job.job_id,
                self.stage,
                self.replica,
                worker.step,
                exc,
            )
        except Exception as exc:  # a bug: this tasklet cannot go on, the job must not wait for it forever
            logger.exception("job %s: tasklet s%sr%s crashed", self.job.job_id, self.stage, self.replica)
            self.state, self.reason = TaskState.FAILED, f"{type(exc).__name__}: {exc}"[:200]
        await self._capture(worker)
        await worker.close()
        self.heartbeat.poke()

    def _on_ban(self, event: BanEvent) -> None:
        """The transport banned a peer (garbage or over-limit streams): if it is a partner, suspect it.

        Its new streams are refused, so when this tasklet's step breaks in this epoch the record
        names that partner, not every partner (a healthy one must not look suspect).
        """
        peer = event.peer.to_base58() if hasattr(event.peer, "to_base58") else str(event.peer)
        if self.commit is None or self.stage is None or peer not in self._partners():
            return
        self.banned[peer] = event
        self.suspects = tuple(sorted(set(self.suspects) | {peer}))[:MAX_SUSPECTS]
        self.heartbeat.poke()
        logger.warning("job %s: partner %s is banned (%s): suspected", self.job.job_id, peer, event.reason)

    def _recovering(self, reason: str) -> None:
        self.state, self.reason = TaskState.RECOVERING, reason[:200]

    async def _stop_tasklet(self, reason: str, state: TaskState) -> None:
        """Cancel the running tasklet, keep its state (``_frozen``), release its worker; lock held."""
        task, self._task = self._task, None
        worker = self.worker
        if task is not None and not task.done():
            await cancel_and_wait(task)
            # a worker its own failure path already captured and closed (a cancel that reached
            # the task while it closed streams can be swallowed there) has nothing left to keep
            if worker is not None and not worker.closed:
                await worker.quiesce()  # the compute thread finished: step and state agree
                await self._capture(worker)
                await worker.tell_neighbours_stopped(reason)
                await worker.close()
            if self.state not in (TaskState.DONE, TaskState.FAILED):
                self.state, self.reason = state, reason[:200]
        self.worker = None
        with contextlib.suppress(PeerdError):
            await self.heartbeat.publish()

    async def _capture(self, worker: StageWorker) -> None:
        """Keep ``worker``'s states (live step and rollback step) without codec buffers (re-plans reset them)."""
        if worker.step == 0 and self._frozen is not None and self._frozen.stage == worker.stage:
            return  # never ran a step: the state held from before stays the better one
        missed = worker.unreported_loss()  # cancelled between its update and its report
        if missed is not None and missed[0] not in {s for s, _ in self.losses}:
            self._add_loss(*missed)
            self.step = max(self.step, missed[0] + 1)
        held = await worker.held_states()  # host copies made in the worker's compute thread
        states = {step: {**state, "codecs": None, "averaging": None} for step, state in held.items()}
        self._frozen = _Frozen(worker.stage, (worker.module.spec.start, worker.module.spec.end), states)
        for kind, n in self._worker_bytes(worker).items():
            self._wire_before[kind] = self._wire_before.get(kind, 0) + n

    async def _load(
        self, worker: StageWorker, span: tuple[int, int], step: int, roster: list[RosterEntry]
    ) -> str:
        """Put ``worker`` at ``step``; returns where the state came from ("init", "memory", "checkpoint", a peer)."""
        assert self.stage is not None
        worker.reset_codecs()  # a new epoch starts every boundary empty on both sides
        if step == 0:
            return "init"  # every peer builds the same initial weights from the job's seed
        state = self._local_state(self.stage, span, step)
        source = "memory" if state is not None else ""
        if state is None:
            state = await asyncio.to_thread(self._checkpoint_state, self.stage, step)
            source = "checkpoint" if state is not None else ""
        if state is None:
            peers = [p for p in holders(roster, self.stage, span, step, job=self.job.job_id) if p != self.me]
            raw = await fetch_state(
                self.transport,
                [self.peer_ref(p) for p in peers],
                self.job.job_id,
                self.stage,
                step,
                max_bytes=state_bound(self.spec),
                config=self.statesync,
            )
            state = await asyncio.to_thread(unpack_state, raw)
            source = f"peer {peers[0] if len(peers) == 1 else 'of ' + ', '.join(peers)}"
        worker.load_state({**state, "codecs": None})
        return source

    def _local_state(self, stage: int, span: tuple[int, int], step: int) -> dict[str, Any] | None:
        frozen = self._frozen
        if frozen is not None and frozen.stage == stage and frozen.layers == span:
            return frozen.states.get(step)
        return None

    def _checkpoint_dirs(self, stage: int) -> list[Path]:
        if self.checkpoint_root is None:
            return []
        root = Path(self.checkpoint_root) / self.job.job_id
        return sorted(root.glob(f"stage{stage}-replica*")) if root.is_dir() else []

    def _checkpoint_steps(self, stage: int) -> set[int]:
        return {s for d in self._checkpoint_dirs(stage) for s in checkpoint.saved_steps(d)}

    def _checkpoint_state(self, stage: int, step: int) -> dict[str, Any] | None:
        """This peer's own checkpoint of ``stage`` at ``step``, else its replica copy; codec buffers dropped."""
        for directory in self._checkpoint_dirs(stage):
            if step in checkpoint.saved_steps(directory):
                state = checkpoint.load(directory, step)
                return {**state, "codecs": None, "averaging": None}
        blob = self.replicas.get(self.job.job_id, stage, step) if self.replicas is not None else None
        return None if blob is None else unpack_state(blob)

    def provide(self, stage: int, step: int) -> bytes | None:
        """State-sync provider (runs in a thread): the packed state of ``stage`` at ``step``, if held here."""
        frozen = self._frozen
        if frozen is not None and frozen.stage == stage and step in frozen.states:
            return pack_state(frozen.states[step])
        if self.replicas is not None and (blob := self.replicas.get(self.job.job_id, stage, step)):
            return blob  # stored as fetched: already without codec buffers
        state = self._checkpoint_state(stage, step)
        return None if state is None else pack_state(state)

    def replica_stages(self) -> list[int]:
        """Stages whose checkpoints this peer keeps copies of in the current allocation."""
        commit = self.commit
        if commit is None or self.checkpoint_replicas < 1:
            return []
        allocation, job = commit.allocation, self.job.job_id
        return [
            stage
            for stage in range(allocation.d_pp)
            if self.me in replica_peers(job, allocation, stage, self.checkpoint_replicas)
        ]

    async def _replicate_loop(self) -> None:
        """Pull each new checkpoint of the stages this peer keeps copies of from that stage's peers."""
        while True:
            await asyncio.sleep(REPLICATE_POLL_S)
            try:
                await self._replicate_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end the copies silently: the next round tries again
                logger.exception("job %s: copying checkpoints failed", self.job.job_id)

    async def _replicate_once(self, *, exact: bool = False) -> None:
        """Copy the newest checkpoint of each stage this peer keeps copies of, if it lacks it.

        ``exact``: a stage whose peers have all stopped (left, or frozen for a re-plan) is copied
        at the step they stopped at, which they serve from memory, before its last checkpoint.
        """
        assert self.replicas is not None
        async with self._copying:
            commit, job, every = self.commit, self.job.job_id, self.spec.checkpoint_interval
            stages = self.replica_stages()
            if commit is None or not stages:
                return
            try:
                progress = await read_progress(self.store, job)
            except PeerdError:
                return
            for stage in stages:
                members = commit.allocation.stages[stage]
                records = [
                    progress[p] for p in members if p in progress and progress[p].epoch == commit.epoch
                ]
                if len(records) < len(members):
                    continue
                reached = min(r.step for r in records)
                targets = [reached // every * every]
                if exact and all(r.state != TaskState.RUNNING for r in records):
                    targets.insert(0, reached)
                await self._copy_newest(commit, job, stage, [t for t in dict.fromkeys(targets) if t > 0])

    async def _copy_newest(self, commit: Commit, job: str, stage: int, targets: list[int]) -> None:
        """Copy ``stage``'s state at the first of ``targets`` its peers serve (none newer than held here)."""
        assert self.replicas is not None
        latest = self.replicas.latest(job, stage)
        for target in targets:
            if latest is not None and latest >= target:
                return
            try:
                await replicate(
                    self.transport,
                    [self.peer_ref(p) for p in commit.allocation.stages[stage]],
                    job,
                    stage,
                    target,
                    self.replicas,
                    max_bytes=state_bound(self.spec),
                    config=self.statesync,
                )
                logger.info("job %s: keeps a copy of stage %d's checkpoint of step %d", job, stage, target)
                return
            except PeerdError as exc:  # not saved yet, or its peers are busy: the next round retries
                logger.debug("job %s: replicating stage %d step %d: %s", job, stage, target, exc)

    # ------------------------------------------------------------------ wiring

    def _reducer(self) -> GroupAllReduce | None:
        assert self.commit is not None and self.stage is not None and self.cfg is not None
        group = self.commit.allocation.stages[self.stage]
        if len(group) == 1:
            return None
        return GroupAllReduce(
            self.transport,
            [self.peer_ref(p) for p in group],
            self.peer_ref(self.me),
            key=f"{self.job.job_id}/s{self.stage}",
            compressor=self.cfg.compression.gradient_compressor,
            timeout=self.cfg.averaging_timeout_s,
            epoch=self.commit.epoch,
            aggregator=self.spec.averaging.build(),
            loss_scaled=self.cfg.precision == "fp16",
        )

    def _neighbour(self, stage: int) -> Any:
        assert self.commit is not None
        allocation = self.commit.allocation
        if not 0 <= stage < allocation.d_pp:
            return None
        return self.peer_ref(allocation.stages[stage][self.replica or 0])

    def _partners(self) -> set[str]:
        """Peers this tasklet opens streams to: its pipeline neighbours and its replica group."""
        assert self.commit is not None and self.stage is not None and self.replica is not None
        stages, r = self.commit.allocation.stages, self.replica
        near = {stages[s][r] for s in (self.stage - 1, self.stage + 1) if 0 <= s < len(stages)}
        return (near | set(stages[self.stage])) - {self.me}

    async def _wait_ready(self) -> None:
        """Wait until every partner published progress for this epoch, i.e. serves its protocols."""
        assert self.commit is not None
        need = self._partners()
        deadline = time.monotonic() + self.ready_timeout
        while True:
            try:
                found = await read_progress(self.store, self.job.job_id)
            except PeerdError as exc:
                logger.debug("job %s: reading progress failed: %s", self.job.job_id, exc)
                found = {}
            epoch = self.commit.epoch
            serving = (TaskState.RUNNING, TaskState.DONE)  # a recovering record of the epoch: still loading
            missing = {
                p for p in need if p not in found or found[p].epoch != epoch or found[p].state not in serving
            }
            if not missing:
                return
            if time.monotonic() > deadline:
                raise PeerUnavailable(
                    f"tasklet partners {sorted(missing)} did not start within {self.ready_timeout:.0f} s",
                    code=ErrorCode.TIMEOUT,
                )
            await asyncio.sleep(READY_POLL_S)

    def _build_worker(self) -> StageWorker:
        assert self.commit is not None and self.cfg is not None
        assert self.stage is not None and self.replica is not None
        reducer = self._group = self._reducer()
        allocation = self.commit.allocation
        worker = StageWorker(
            self.cfg,
            stage=self.stage,
            replica=self.replica,
            replicas=allocation.d_dp,
            transport=self.transport,
            upstream=self._neighbour(self.stage - 1),
            downstream=self._neighbour(self.stage + 1),
            reducer=reducer,
            on_report=self._on_report,
            epoch=self.commit.epoch,
        )
        if reducer is not None:
            # the group's frames: this stage's gradients, not the default 1 GiB
            reducer.max_numel = sum(p.numel() for p in worker.params)
        return worker

    # ------------------------------------------------------------------ progress

    def _on_report(self, report: StepReport) -> None:
        worker = self.worker
        now = time.perf_counter()
        if worker is not None and len(worker.reports) > 1:  # a worker's first step warms up: not counted
            for phase, seconds in report.phases_s.items():
                self._phase_sums[phase] = self._phase_sums.get(phase, 0.0) + seconds
            self._phase_steps += 1
            if self._step_end is not None:
                self._steady_s += now - self._step_end
        self._step_end = now
        self.step = report.step + 1
        self.tokens_per_s = report.tokens_per_s
        if report.loss is not None:
            self._add_loss(report.step, report.loss)
        if report.val_loss is not None:
            self.val_losses.append((report.step + 1, report.val_loss))
        if worker is not None:
            self.wire = self._bytes(worker)
        self.heartbeat.poke()

    def _add_loss(self, step: int, loss: float) -> None:
        self.losses.append((step, loss))
        if self.commit is not None and self.commit.allocation.d_dp > 1:
            self._shared_steps.add(step)  # one replica's loss, not the job's

    def phases(self) -> dict[str, float]:
        """Mean seconds per step in each phase of ``StepReport.phases_s`` (each worker's first step left out)."""
        n = self._phase_steps
        return {phase: seconds / n for phase, seconds in self._phase_sums.items()} if n else {}

    def s_per_step(self) -> float | None:
        """Mean wall seconds from one step's end to the next one's, over the steps ``phases`` counts: the
        phases plus whatever runs between steps (the report, the progress record)."""
        return self._steady_s / self._phase_steps if self._phase_steps else None

    def _worker_bytes(self, worker: StageWorker) -> dict[str, int]:
        sent = {"activations": 0, "gradients": 0, "activations_raw": 0, "gradients_raw": 0}
        names = {"fwd": "activations", "bwd": "gradients", "val": "validation"}  # held-out: outside the ratio
        for (_, traffic), counters in worker.stats.sent.items():
            sent[names[traffic]] = sent.get(names[traffic], 0) + counters.wire_bytes
            if traffic != "val":
                sent[f"{names[traffic]}_raw"] += counters.raw_bytes
        stats = getattr(worker.reducer, "stats", None)
        sent["averaging"] = int(getattr(stats, "bytes_sent", 0))
        sent["averaging_raw"] = int(getattr(stats, "raw_bytes_sent", 0))  # counted with the wire bytes
        return sent

    def _bytes(self, worker: StageWorker) -> dict[str, int]:
        """Bytes sent for this job so far (this worker's and its predecessors'), wire and raw by kind."""
        now = self._worker_bytes(worker)
        return {k: now.get(k, 0) + self._wire_before.get(k, 0) for k in {*now, *self._wire_before}}

    def progress(self) -> Progress | None:
        """This tasklet's record for the current commit; None for a spare (it runs no tasklet)."""
        if self.commit is None or self.stage is None or self.replica is None:
            return None
        last = self.losses[-1][1] if self.losses else None
        return Progress(
            job_id=self.job.job_id,
            peer=self.me,
            epoch=self.commit.epoch,
            stage=self.stage,
            replica=self.replica,
            step=min(self.step, self.spec.steps),
            steps=self.spec.steps,
            state=self.state,
            tokens_per_s=float(self.tokens_per_s),
            updated_at=self.store.now(),
            started_at=self.started_at,
            loss=last,
            losses=downsample(self.losses),
            bytes=dict(self.wire),
            reason=self.reason,
            suspects=tuple(sorted(self.suspects)) if self.state == TaskState.RECOVERING else (),
            replicas=self.commit.allocation.d_dp,
            val_losses=downsample(self.val_losses, MAX_VAL_POINTS),
        )
