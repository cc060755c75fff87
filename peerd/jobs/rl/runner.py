"""This peer's part in one ``rl`` job across commits: a trainer (a tasklet of the allocation's one stage) or a rollout peer (a spare).

``RLRunner`` has the interface ``peerd.jobs.manager`` drives a runner through (``start``,
``adopt``, ``freeze``, ``leave``, ``retire``, ``close``, ``held``, ``progress``, ``running``,
``unfit``, and ``stage``/``replica``/``state``/``step``/``recoveries`` for the views). On each
commit the peers of ``allocation.stages[0]`` (its replicas, in order) run ``RLTrainer``, data
parallel when there are several (they average every update's gradients over
``peerd.averaging``), and the spares are the rollout peers, dealt over the trainers by
``assign_shards``; a trainer left without one samples its own shard (colocated). A trainer
resumes from the newest policy version anyone declares: its memory when that is it (it stayed
a trainer), else its own checkpoint, its copy of one, or a copy fetched from the roster's
members; with none it warms up. ``checkpoint_replicas`` rollout peers (``replica_peers``) keep
copies of the trainers' newest checkpoint, so a trainer whose peer is gone costs the iterations
since it.

Each trainer publishes a progress record (stage 0, its replica, step = iterations done, the
GRPO loss curve, ``rl`` figures from its reports: the rewards pooled over every trainer's
groups) every ``interval`` seconds and after each iteration; it serves its checkpoints on
``state_protocol(job)`` so ``peerd fetch --p2p`` works; rollout peers publish nothing (as
spares of a pretraining job). When the last iteration is done a trainer keeps serving until
every rollout peer of its own heard so (``farewell``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from peerd.errors import ConfigError, PeerdError
from peerd.jobs.heartbeat import ProgressPublisher
from peerd.jobs.records import MAX_SUSPECTS, JobRecord, Progress, TaskState, downsample
from peerd.jobs.recovery import CHECKPOINT_REPLICAS, held_state, holders, replica_peers, resume_step
from peerd.jobs.rl.learner import Learner
from peerd.jobs.rl.means import TrainerMeans, trainer_means
from peerd.jobs.rl.progress import RunFigures
from peerd.jobs.rl.report import IterationReport
from peerd.jobs.rl.rollout import RolloutConfig, RolloutPeer
from peerd.jobs.rl.shards import RLPlan, assign_shards
from peerd.jobs.rl.trainer import RLTrainer, TrainerConfig
from peerd.jobs.spec import JobSpec
from peerd.jobs.store import RecordStore
from peerd.log import get_logger
from peerd.pipeline import checkpoint
from peerd.pipeline.replicas import CheckpointReplicas, check_checkpoint, replicate
from peerd.pipeline.statesync import StateServer, StateSyncConfig, fetch_state, pack_state, unpack_state
from peerd.sched.consensus.actions import Commit
from peerd.sched.consensus.messages import HeldState, RosterEntry
from peerd.swarm.profiling import resolve_device
from peerd.swarm.transport import Transport
from peerd.tasks import cancel_and_wait

log = get_logger(__name__)

FAREWELL_S = 30.0  # how long a finished trainer waits for its rollout peers to hear "done"


class RLRunner:
    """This peer's role in one ``rl`` job: ``start``, ``adopt`` each commit, ``freeze`` on a failure, ``close``."""

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
        statesync: StateSyncConfig | None = None,
        trainer_config: TrainerConfig | None = None,
        rollout_config: RolloutConfig | None = None,
        device: str = "auto",
        replicas: CheckpointReplicas | None = None,
        checkpoint_replicas: int = CHECKPOINT_REPLICAS,
        online: Callable[[], Collection[str]] | None = None,
        **_: Any,  # TaskletRunner's other options (ready_timeout, ...) do not apply
    ) -> None:
        self.job, self.spec, self.store = job, spec, store
        self.transport, self.peer_ref, self.interval = transport, peer_ref, interval
        self.checkpoint_root = checkpoint_root
        self.statesync = statesync or StateSyncConfig()
        self.trainer_config = trainer_config or TrainerConfig(
            checkpoint_root=checkpoint_root, statesync=self.statesync
        )
        self.rollout_config = rollout_config or RolloutConfig(statesync=self.statesync)
        self.plan = RLPlan(job.job_id, spec)
        self.device = device  # where this peer's role computes (the daemon's --device)
        self.replicas = replicas  # copies of the trainer's checkpoints kept here (a rollout peer's)
        self.checkpoint_replicas = checkpoint_replicas
        self.online = online  # the peers the swarm lists (a trainer stops waiting for a vanished one)
        self.commit: Commit | None = None
        self.role: str | None = None
        """``trainer``, ``rollout`` or None (not in the current commit)."""
        self.stage: int | None = None  # 0 for a trainer (the one stage), None for a rollout peer
        self.replica: int | None = None
        self.unfit: str | None = None  # never set: an rl role has no device fit check yet
        self.state = TaskState.RUNNING
        self.reason = ""
        self.step = 0
        self.recoveries: list[dict[str, Any]] = []
        self.started_at = store.now()
        self.retired = False
        self.reports: list[IterationReport] = []
        self.run = RunFigures()  # the same reports, folded as they come (what the record shows)
        self.trainer: RLTrainer | None = None
        self.rollout: RolloutPeer | None = None
        self._learner: Learner | None = None  # the policy a stopped trainer leaves for the next commit
        self._task: asyncio.Task | None = None
        self._replicator: asyncio.Task | None = None
        # a running trainer's records are spaced ``interval`` apart: a small policy's iterations take
        # milliseconds, and a record per iteration kept the trainer's event loop, its DHT and every
        # peer that stores the record busy, on the cores the trainer computes on
        self.heartbeat = ProgressPublisher(
            store,
            job.job_id,
            self.progress,
            interval=interval,
            paced=lambda: self.state == TaskState.RUNNING and self.role == "trainer",
        )
        self._lock = asyncio.Lock()
        self.server = StateServer(transport, job.job_id, self.provide, config=self.statesync)

    @property
    def me(self) -> str:
        return self.store.me

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Serve the job's checkpoints (``state_protocol(job)``) and publish progress."""
        await self.server.start()
        self.heartbeat.start()

    async def close(self) -> None:
        """Stop the role, publish the last record, stop serving; never raises."""
        if not self.retired:
            async with self._lock:
                with contextlib.suppress(Exception):
                    await self._stop("its daemon shut down", TaskState.LEFT)
        await self.heartbeat.stop()
        with contextlib.suppress(Exception):
            await self.server.close()

    async def retire(self) -> None:
        """The job ended: stop the role, keep serving the checkpoints held here (idempotent)."""
        if self.retired:
            return
        self.retired = True
        async with self._lock:
            if self.running:
                await self._stop("the job ended", TaskState.DONE)
        await self.heartbeat.stop()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # ------------------------------------------------------------------ churn API

    def held(self) -> tuple[HeldState, ...]:
        """The trainer state this peer can give: the stopped policy's version and the checkpoints on disk."""
        steps = set(self._checkpoint_steps())
        if self.replicas is not None:
            steps |= set(self.replicas.steps(self.job.job_id, 0))
        if self._learner is not None:
            steps.add(self._learner.version)
        layers = (0, self.spec.model.family().num_layers)
        return (held_state(0, layers, steps),) if steps else ()

    async def freeze(self, reason: str) -> None:
        """Stop the role where it is (the trainer keeps its policy in memory) and wait for the re-plan."""
        async with self._lock:
            if self.running:
                await self._stop(reason, TaskState.RECOVERING)

    async def leave(self, reason: str) -> None:
        """Stop the role and publish ``left`` (the others re-plan without this peer); keep serving checkpoints."""
        async with self._lock:
            await self._stop(reason, TaskState.LEFT)
            if self.state not in (TaskState.DONE, TaskState.FAILED):
                self.state, self.reason = TaskState.LEFT, reason[:200]
            with contextlib.suppress(PeerdError):
                await self.heartbeat.publish()

    async def adopt(
        self, commit: Commit, roster: list[RosterEntry] | None, history: Sequence[tuple[int, float]] = ()
    ) -> None:
        """Take this peer's role in ``commit``: the trainer (its one tasklet), a rollout peer (a spare), or none.

        ``roster`` and ``history`` are accepted for the manager's call; the trainer's own memory and
        checkpoints are the state it resumes from (another peer's trainer state is not fetched yet).
        """
        async with self._lock:
            if self.commit is not None and commit.epoch <= self.commit.epoch:
                return
            started = time.monotonic()
            # a trainer whose run ended on its own (a failed average) still serves its protocols
            if self.running or self.trainer is not None or self.rollout is not None:
                await self._stop(
                    f"superseded by the allocation of epoch {commit.epoch}", TaskState.RECOVERING
                )
            self.commit = commit
            alloc = commit.allocation
            if len(alloc.stages) != 1:
                self.state, self.reason = (
                    TaskState.FAILED,
                    f"an rl job has one stage, got {len(alloc.stages)}",
                )
                self.heartbeat.poke()
                return
            trainers = list(alloc.stages[0])
            rollout_peers = [p for p in alloc.spares if p not in trainers]
            try:
                device = resolve_device(self.device)
            except ConfigError as exc:  # this peer cannot run it: the reason says why
                self.state, self.reason = TaskState.FAILED, str(exc)[:200]
                self.heartbeat.poke()
                return
            if self.me in trainers:
                self.role, self.stage, self.replica = "trainer", 0, trainers.index(self.me)
                try:
                    source = await self._learner_source(device, roster or [])
                except PeerdError as exc:  # no holder delivered: wait for the next re-plan
                    self.state, self.reason = (
                        TaskState.RECOVERING,
                        f"could not take the trainer's state: {exc}"[:200],
                    )
                    self.heartbeat.poke()
                    return
                resume = self._learner.version if self._learner is not None else 0
                self._rewind(resume)
                self.recoveries.append(
                    {
                        "epoch": commit.epoch,
                        "resume_step": resume,
                        "source": source,
                        "seconds": round(time.monotonic() - started, 3),
                    }
                )
                self.trainer = RLTrainer(
                    self.transport,
                    self.plan,
                    [self.peer_ref(p) for p in rollout_peers],
                    config=self.trainer_config,
                    on_iteration=self._on_iteration,
                    learner=self._learner,
                    device=device,
                    trainers=len(trainers),
                    replica=self.replica,
                    group=self._averaging_group(commit.epoch, trainers),
                    gone=self._gone,
                )
                self._learner = None
                self.state, self.reason = TaskState.RUNNING, ""
                self._task = asyncio.create_task(self._run_trainer(self.trainer))
            elif self.me in rollout_peers:
                self.role, self.stage, self.replica = "rollout", None, None
                layout = assign_shards(self.plan.prompts, len(trainers), rollout_peers)
                (shard,) = [s for s in layout if s.sampler == self.me]
                trainer = trainers[shard.trainer]
                self.rollout = RolloutPeer(
                    self.transport,
                    self.plan,
                    self.peer_ref(trainer),
                    shard,
                    config=self.rollout_config,
                    device=device,
                )
                self.state, self.reason = TaskState.RUNNING, ""
                self._task = asyncio.create_task(self._run_rollout(self.rollout))
                keepers = replica_peers(self.job.job_id, alloc, 0, self.checkpoint_replicas)
                if self.replicas is not None and self.spec.checkpoint_interval and self.me in keepers:
                    self._replicator = asyncio.create_task(self._replicate_loop(self.rollout, trainer))
            else:
                self.role = self.stage = self.replica = None
            self.heartbeat.poke()

    def _bytes_sent(self) -> dict[str, int]:
        """The record's wire bytes by kind: weights served, and the trainers' averaging (if they average)."""
        sent = {"weight_sync": self.run.weight_sync_bytes}
        if self.run.averaging_raw_bytes:
            sent |= {"averaging": self.run.averaging_bytes, "averaging_raw": self.run.averaging_raw_bytes}
        return sent

    # ------------------------------------------------------------------ the roles

    def _gone(self, peer: str) -> bool:
        """Whether the swarm no longer lists ``peer`` (never, without the daemon's list)."""
        return self.online is not None and peer not in self.online()

    def _averaging_group(self, epoch: int, trainers: list[str]) -> TrainerMeans | None:
        """The data-parallel trainers' averaging of this commit (None for a lone trainer)."""
        if len(trainers) < 2:
            return None
        return trainer_means(self.transport, [self.peer_ref(p) for p in trainers], self.plan, epoch)

    async def _learner_source(self, device: torch.device, roster: list[RosterEntry]) -> str:
        """Where the trainer's policy comes from: the newest version this peer's memory, its own
        checkpoints, its copies of a trainer's checkpoints or ``roster``'s members hold (every trainer
        of a commit computes the same from the same roster), or the warm-up when there is none."""
        job, layers = self.job.job_id, (0, self.spec.model.family().num_layers)
        own = self._checkpoint_steps()
        copies = self.replicas.steps(job, 0) if self.replicas is not None else []
        offered = resume_step(roster, [layers])
        memory = self._learner.version if self._learner is not None else 0
        step = max([0, memory, *own, *copies, offered])
        if self._learner is not None and memory == step:
            return "memory"
        self._learner = None  # older than what another trainer continues from
        if step == 0:
            return "init"
        blob: bytes | None
        if step in own:
            blob, source = checkpoint.checkpoint_file(self._dir(), step).read_bytes(), "checkpoint"
        elif step in copies:
            assert self.replicas is not None
            blob, source = self.replicas.get(job, 0, step), "replica"
        else:
            peers = [p for p in holders(roster, 0, layers, step, job=job) if p != self.me]
            blob = await fetch_state(
                self.transport,
                [self.peer_ref(p) for p in peers],
                job,
                0,
                step,
                max_bytes=self.plan.weights_bound * 4,
                config=self.statesync,
            )
            source = "peers " + ", ".join(peers)
        assert blob is not None
        await asyncio.to_thread(check_checkpoint, blob, job, 0, step)
        learner = Learner(self.plan, device)
        await asyncio.to_thread(learner.restore, unpack_state(blob))
        self._learner = learner
        return source

    async def _run_trainer(self, trainer: RLTrainer) -> None:
        try:
            await trainer.start()
            self.step = trainer.learner.version
            self.heartbeat.poke()
            await trainer.run()
            self.state = TaskState.DONE
            self.heartbeat.poke()
            if not await trainer.farewell(FAREWELL_S):
                log.info("rl job %s: not every rollout peer heard that the job is done", self.job.job_id)
        except asyncio.CancelledError:
            raise
        except ConfigError as exc:
            self.state, self.reason = TaskState.FAILED, str(exc)[:200]
        except PeerdError as exc:
            self.state, self.reason = TaskState.RECOVERING, str(exc)[:200]
            log.warning("rl job %s: the trainer stopped: %s", self.job.job_id, exc)
        except Exception as exc:  # a bug: the job must not wait for this trainer forever
            log.exception("rl job %s: the trainer crashed", self.job.job_id)
            self.state, self.reason = TaskState.FAILED, f"{type(exc).__name__}: {exc}"[:200]
        finally:
            self.heartbeat.poke()

    async def _run_rollout(self, rollout: RolloutPeer) -> None:
        try:
            await rollout.run()
            self.state = TaskState.DONE
        except asyncio.CancelledError:
            raise
        except PeerdError as exc:  # the trainer is gone: the health check re-plans
            self.state, self.reason = TaskState.RECOVERING, str(exc)[:200]
            log.warning("rl job %s: rollouts stopped: %s", self.job.job_id, exc)

    async def _replicate_loop(self, rollout: RolloutPeer, trainer: str) -> None:
        """Keep a copy of the trainer's newest checkpoint (every ``checkpoint_interval`` versions and
        the last): a new trainer resumes from it if the trainer's peer is gone."""
        assert self.replicas is not None
        every, last = self.spec.checkpoint_interval, self.spec.steps
        while True:
            seen = rollout.trainer_version
            step = last if seen >= last else seen - seen % every
            if step > 0 and step not in self.replicas.steps(self.job.job_id, 0):
                try:
                    await replicate(
                        self.transport,
                        [self.peer_ref(trainer)],
                        self.job.job_id,
                        0,
                        step,
                        self.replicas,
                        self.plan.weights_bound * 4,
                        config=self.statesync,
                    )
                    self.heartbeat.poke()
                except PeerdError as exc:  # not written yet, or the trainer is gone: try again soon
                    # (a version is published before its checkpoint is written: waiting a whole
                    # interval can miss every checkpoint of a fast job but its last)
                    log.debug("rl job %s: copying checkpoint %d: %s", self.job.job_id, step, exc)
                    await asyncio.sleep(self.interval / 8)
                    continue
            await asyncio.sleep(self.interval)

    def _rewind(self, step: int) -> None:
        """Forget the reports of iterations ``step`` and later: the trainer trains them again from an
        older policy, and the record's curve must stay strictly ascending (a record that repeats an
        iteration is refused by the wire checks, which left the trainer silent until a re-plan)."""
        if any(r.iteration >= step for r in self.reports):
            self.reports = [r for r in self.reports if r.iteration < step]
            self.run = RunFigures.of(self.reports)

    def _on_iteration(self, report: IterationReport) -> None:
        self.reports.append(report)
        self.run.add(report)
        self.step = report.version
        self.heartbeat.poke()

    async def _stop(self, reason: str, state: TaskState) -> None:
        """Cancel the role; a trainer's policy stays in memory for the next commit; lock held."""
        replicator, self._replicator = self._replicator, None
        await cancel_and_wait(replicator)
        task, self._task = self._task, None
        if task is not None and not task.done():
            await cancel_and_wait(task)
            if self.state not in (TaskState.DONE, TaskState.FAILED):
                self.state, self.reason = state, reason[:200]
        if self.trainer is not None:
            await self.trainer.close()
            self.step = self.trainer.learner.version
            if self.state != TaskState.DONE and not self.trainer.learner.torn:
                self._learner = self.trainer.learner
            self.trainer = None
        self.rollout = None
        with contextlib.suppress(PeerdError):
            await self.heartbeat.publish()

    # ------------------------------------------------------------------ checkpoints

    def _dir(self) -> Path:
        assert self.checkpoint_root is not None
        return checkpoint.tasklet_dir(self.checkpoint_root, self.job.job_id, 0, 0)

    def _checkpoint_steps(self) -> list[int]:
        return checkpoint.saved_steps(self._dir()) if self.checkpoint_root is not None else []

    def provide(self, stage: int, step: int) -> bytes | None:
        """A checkpoint's bytes, its own or a copy (stage 0 only: the policy is one stage), for
        ``peerd fetch --p2p`` and for a trainer taking over."""
        if stage != 0:
            return None
        learner = self._learner  # a stopped trainer's policy (held() declares its version)
        if learner is not None and learner.version == step:
            return pack_state(learner.checkpoint_state())
        if step in self._checkpoint_steps():
            return checkpoint.checkpoint_file(self._dir(), step).read_bytes()
        return self.replicas.get(self.job.job_id, 0, step) if self.replicas is not None else None

    # ------------------------------------------------------------------ progress

    def phases(self) -> dict[str, float]:
        """None: the pipeline's phases do not apply to rl roles (``peerd bench rl-swarm`` times their tasks)."""
        return {}

    def s_per_step(self) -> None:
        """None: an rl trainer's iterations are timed in its record (``steady_rollouts_per_s``, ``phases_s``)."""
        return None

    def progress(self) -> Progress | None:
        """The trainer's record for the current commit; None for a rollout peer (it runs no tasklet)."""
        if self.commit is None or self.role != "trainer":
            return None
        version = self.trainer.version if self.trainer is not None else self.step
        # keyed by iteration index, as a pipeline's losses by step index (views.loss_curve counts a
        # point once the record has completed more iterations than it)
        return Progress(
            job_id=self.job.job_id,
            peer=self.me,
            epoch=self.commit.epoch,
            stage=0,
            replica=self.replica or 0,
            step=min(self.step, self.spec.steps),
            steps=self.spec.steps,
            state=self.state,
            tokens_per_s=0.0,
            updated_at=self.store.now(),
            started_at=self.started_at,
            loss=None,  # the record's latest loss is >= 0 (a pretraining loss); GRPO's can be negative: see losses
            losses=downsample(self.run.losses),
            bytes=self._bytes_sent(),
            reason=self.reason,
            # rollout peers that missed their shard's deadline: the trainer covers their shards
            suspects=tuple(self.trainer.absent_peers[:MAX_SUSPECTS]) if self.trainer is not None else (),
            replicas=len(self.commit.allocation.stages[0]),
            rl=self.run.figures(max(version, 0)),
        )
