"""The trainer peer of an ``rl`` job: warm-up, weights served by version, rollouts taken in, GRPO iterations.

``RLTrainer`` runs on the Transport of the allocation's one tasklet peer. It serves two
protocols: ``state_protocol(weights_job(job))`` (``peerd.pipeline.statesync``: stage 0, step =
policy version, the packed weights of the last ``staleness + 2`` versions) and
``rl_protocol(job)`` (``peerd.jobs.rl.messages``: shards of rollouts in, acks out, and long
polls for the latest version, answered with the weights inside when the poller holds an older
version and takes a blob that size), open to the job's rollout peers only.

Iteration ``t`` waits for every expected rollout peer's shard at most ``rl.rollout_timeout_s``,
or until the swarm no longer lists its peer (``gone``, asked every ``GONE_CHECK_S``: a crashed
peer's record expires long before a generous timeout);
a shard still missing then is dropped and counted, and its peer is not waited for again until
it delivers something; meanwhile the trainer samples that peer's shards itself (same generator,
current version: what the peer would have sent), so a vanished peer costs one timeout and the
shard it had in flight, and a re-plan (``absent_peers``) can drop it. Shards arrive checked (``check_rollouts``); one of a version older than
``t - staleness`` or of an iteration already trained is answered "not accepted" and counted.
The trainer scores every completion with its own verifier, trains version ``t`` into ``t + 1``
(``Learner``, in a worker thread: the event loop keeps answering), publishes it, checkpoints
every ``checkpoint_interval`` iterations and at the end in the one-stage checkpoint format
(``peerd fetch`` assembles it), and hands an ``IterationReport`` to ``on_iteration``.

Data-parallel trainers (``trainers`` > 1, each its ``replica``): each takes the shards
``assign_shards`` gives it (sampling itself those no rollout peer of its own samples), trains on
its own groups and averages every update with the others over ``group`` (``means.trainer_means``);
they start from the group's mean weights and pool the iteration's reward figures into its first
average, so every trainer reports the job's figures.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from peerd.errors import ErrorCode, ProtocolError
from peerd.jobs.rl.intake import Intake
from peerd.jobs.rl.learner import Learner
from peerd.jobs.rl.means import PooledRewards, TrainerMeans
from peerd.jobs.rl.messages import (
    REQUEST_KINDS,
    Ack,
    Poll,
    RolloutBounds,
    Rollouts,
    Status,
    header,
    parse,
    rl_protocol,
    to_wire,
    weights_job,
)
from peerd.jobs.rl.report import IterationReport, score, summarize
from peerd.jobs.rl.shards import RLPlan, assign_shards, sample_shard
from peerd.log import get_logger
from peerd.pipeline import checkpoint
from peerd.pipeline.statesync import StateServer, StateSyncConfig
from peerd.rl.rollout import RolloutGroup
from peerd.rl.update import Average
from peerd.rl.weights import pack_weights
from peerd.swarm.framing import FrameLimits, StreamClosed
from peerd.swarm.transport import Connection, Transport

log = get_logger(__name__)

T = TypeVar("T")
STOP_GRACE_S = 10.0  # how long a stopped trainer lets its iteration finish before it stops averaging
GONE_CHECK_S = 1.0  # how often a trainer waiting for shards asks whether their peers are still in the swarm
WEIGHTS_STAGE = 0  # the statesync stage field of policy weights (an rl job has one "stage")


@dataclass(frozen=True)
class TrainerConfig:
    """Timing of the trainer's service (sizes and the rollout timeout come from the spec)."""

    poll_hold_s: float = 10.0
    """Longest an ``rl.poll`` is held before the trainer answers with what it has."""
    idle_s: float = 600.0
    """A rollout stream that sends nothing for this long is closed."""
    cover_absent: bool = True
    """The trainer samples the shards of rollout peers that missed an earlier iteration's deadline
    itself, from the next iteration on, until they deliver again (their prompts stay in the batch;
    a vanished peer costs only the shard it had in flight). False: those prompts are left out."""
    checkpoint_root: Path | None = None
    """Where checkpoints go (``checkpoint.tasklet_dir(root, job, 0, 0)``); None: no checkpoints."""
    statesync: StateSyncConfig = field(default_factory=StateSyncConfig)


# Work this small runs on the event loop: a hand-off to a worker thread and back cost ~0.5 ms on a
# busy 2-core machine (``scripts/rl_sync_timeline.py``), several times packing a 0.2 MB policy
# (~0.25 ms) or scoring 128 short completions (~0.15 ms), while the loop stalls for a ms or two.
INLINE_WEIGHTS = 1 << 18
"""Policy values packed or loaded on the loop (~2 ns each)."""
INLINE_TOKENS = 1 << 12
"""Completion tokens scored on the loop (~0.4 µs each: decoding and matching in Python)."""


async def _small_inline(size: int, limit: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the loop when ``size`` is at most ``limit``, else in a worker thread."""
    if size <= limit:
        return fn(*args)
    return await _in_thread(fn, *args)


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread; a cancelled caller still waits for it (the policy must not
    change under whoever runs next)."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise


def generation_seconds(shards: dict[int, Rollouts]) -> dict[str, float]:
    """``{"generate": s}``: the slowest shard's sampling time its peer reported (the rollout peers
    sample in parallel); empty when no shard said (older peers)."""
    said = [m.sample_s for m in shards.values() if m.sample_s is not None]
    return {"generate": max(said)} if said else {}


class RLTrainer:
    """Trains an ``rl`` job with the rollouts of ``rollout_peers``; ``run`` returns one report per iteration."""

    def __init__(
        self,
        transport: Transport,
        plan: RLPlan,
        rollout_peers: Sequence[Hashable],
        *,
        config: TrainerConfig = TrainerConfig(),
        on_iteration: Callable[[IterationReport], None] | None = None,
        learner: Learner | None = None,
        device: torch.device | str = "cpu",
        trainers: int = 1,
        replica: int = 0,
        group: TrainerMeans | None = None,
        gone: Callable[[str], bool] = lambda _peer: False,
    ) -> None:
        """``rollout_peers``: every rollout peer of the job (``assign_shards`` deals them over the
        ``trainers``; this one is ``replica``); ``learner``: continue its policy at its version (a
        re-plan, a checkpoint) instead of warming up; ``device``: where a new learner trains (and
        samples its own shards); ``group``: the data-parallel trainers' averaging group (None or a
        group of one: this trainer alone); ``gone(peer)``: whether the swarm no longer lists that
        rollout peer (its shard is not waited for any longer)."""
        self.transport, self.plan, self.config = transport, plan, config
        self._gone = gone
        self.on_iteration = on_iteration
        self.replica, self.group = replica, group if group is not None and group.size > 1 else None
        self.average: Average | None = None  # the group's mean, once started
        self.layout = assign_shards(plan.prompts, trainers, [str(p) for p in rollout_peers])
        own = [s for s in self.layout if s.trainer == replica]
        samplers = {s.index: s.sampler for s in own if s.sampler is not None}
        self.peers = sorted((p for p in rollout_peers if str(p) in samplers.values()), key=str)
        self.own_shards = [s.index for s in own if s.sampler is None and s.problems]
        """Shards nobody samples for this trainer: it samples them itself every iteration (colocated)."""
        self.shards = [s.problems for s in self.layout]
        self.bounds = RolloutBounds(
            iterations=plan.iterations,
            shards=self.shards,
            group_size=plan.group_size,
            max_new_tokens=plan.max_new_tokens,
            vocab_size=plan.vocab_size,
        )
        self.resumed = learner is not None
        self.learner = learner if learner is not None else Learner(plan, device)
        self.intake = Intake(samplers, self.bounds, plan.rl.staleness, iteration=self.learner.version)
        self.reports: list[IterationReport] = []
        self.refused: Counter[ErrorCode] = Counter()
        """Rollout frames refused as protocol errors, by code (none of them is trained on)."""
        self.staleness: Counter[int] = Counter()
        self.covered_shards = 0
        """Shards of absent rollout peers that the trainer sampled itself (``TrainerConfig.cover_absent``)."""
        self._blobs: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._changed = asyncio.Condition()
        self._served = False
        self._weights = StateServer(
            transport, weights_job(plan.job_id), self._provide, config=config.statesync
        )
        self._stale_seen = self._late_seen = self._bytes_seen = self._inline_bytes = 0
        self._averaged_seen = (0, 0)  # the groups' bytes (wire, raw) at the last report
        self._waited_seen = 0.0  # the groups' wait for the other trainers at the last report
        self.told: set[str] = set()
        """Rollout peers that were answered ``done``."""

    # ------------------------------------------------------------ service

    def _provide(self, stage: int, step: int) -> bytes | None:
        return self._blobs.get(step) if stage == WEIGHTS_STAGE else None

    @property
    def absent_peers(self) -> list[str]:
        """Rollout peers that missed a shard deadline and have not delivered since (what a re-plan should drop)."""
        return sorted(self.intake.peers[s] for s in self.intake.absent)

    @property
    def iteration(self) -> int:
        """The iteration whose shards are awaited."""
        return self.intake.iteration

    @property
    def version(self) -> int:
        """Latest published policy version (-1 until the warm-up is done)."""
        return self.intake.version

    @property
    def done(self) -> bool:
        return self.intake.done

    @property
    def dropped_stale(self) -> int:
        return self.intake.dropped_stale

    @property
    def dropped_late(self) -> int:
        return self.intake.dropped_late

    @property
    def missing_shards(self) -> int:
        return self.intake.missing_shards

    @property
    def weight_sync_bytes(self) -> int:
        """Policy bytes served to rollout peers: by state sync and inside poll answers."""
        return self._weights.bytes_served + self._inline_bytes

    async def start(self) -> None:
        """Serve weights and rollouts, warm up (unless resumed), publish the current version.

        The rl protocol is served during the warm-up, so rollout peers hear "not ready" (and
        keep polling) instead of finding no trainer for as long as the warm-up takes.
        """
        await self._weights.start()
        if self.group is not None:
            self.average = self.group.mean(asyncio.get_running_loop())
        allowed = {str(p) for p in self.peers}
        await self.transport.serve(
            rl_protocol(self.plan.job_id),
            self._handle,
            lambda peer: str(peer) in allowed,
            limits=FrameLimits(max_header=self.bounds.frame_bytes(), max_payload=0),
        )
        self._served = True
        if not self.resumed:
            warm = await _in_thread(self.learner.warm_up)
            if warm.losses:
                log.info(
                    "rl job %s: warm-up %d steps, loss %.3f -> %.3f",
                    self.plan.job_id,
                    len(warm.losses),
                    warm.losses[0],
                    warm.losses[-1],
                )
        if self.average is not None:
            # trainers that warmed up on different hardware round differently, and one that resumed
            # from memory or a checkpoint holds what another fetched: every trainer starts equal
            assert self.group is not None
            await self.group.start()
            await _in_thread(self.learner.align, self.average)
            self._waited_seen = self.group.waited_s()  # the alignment's waits are no iteration's
        await self._publish()

    async def close(self) -> None:
        """Stop serving (rollout peers then find no trainer; ``done`` is only said after the last iteration)."""
        if self._served:
            self._served = False
            await self.transport.stop_serving(rl_protocol(self.plan.job_id))
        await self._weights.close()
        if self.group is not None:
            await self.group.close()

    async def _publish(self) -> None:
        version = self.learner.version
        blob = await _small_inline(
            self.learner.numel, INLINE_WEIGHTS, lambda: pack_weights(version, self.learner.weights())
        )
        self._blobs[version] = blob
        while len(self._blobs) > self.plan.rl.staleness + 2:
            self._blobs.popitem(last=False)
        async with self._changed:
            self.intake.version = version
            self._changed.notify_all()

    async def _handle(self, conn: Connection) -> None:
        while True:
            try:
                raw, _ = await conn.recv(timeout=self.config.idle_s)
            except StreamClosed:
                return
            try:
                msg = parse(raw, REQUEST_KINDS)
                payload = b""
                if isinstance(msg, Rollouts):
                    reply: Ack | Status = await self._take(conn.peer_id, msg)
                else:
                    reply, payload = await self._status(msg)
            except ProtocolError as exc:
                self.refused[exc.code] += 1
                log.warning("rl job %s: refused a frame of %s: %s", self.plan.job_id, conn.peer_id, exc)
                raise  # the Transport answers with the code and ends the stream
            await conn.send(header(reply), payload, timeout=30.0)
            self._inline_bytes += len(payload)
            if reply.done:
                async with self._changed:
                    self.told.add(str(conn.peer_id))
                    self._changed.notify_all()

    async def _status(self, poll: Poll) -> tuple[Status, bytes]:
        """The status a poll waits for, with the weights of its version inside when the poller holds
        an older one and takes a blob that size (one round trip instead of a state-sync fetch)."""
        async with self._changed:
            try:
                async with asyncio.timeout(self.config.poll_hold_s):
                    await self._changed.wait_for(lambda: self.done or self.version >= poll.want)
            except TimeoutError:
                pass
            status = self.intake.status()
        blob = self._blobs.get(status.version) if status.ready and not status.done else None
        newer = poll.held is None or poll.held < status.version
        if blob is None or not newer or len(blob) > (poll.inline_bytes or 0):
            return status, b""
        status.weights = True
        return status, blob

    async def _take(self, peer: Hashable, msg: Rollouts) -> Ack:
        async with self._changed:
            ack = self.intake.take(str(peer), msg)
            if ack.accepted:
                self._changed.notify_all()
        return ack

    # ------------------------------------------------------------ the loop

    async def _collect(self, t: int) -> dict[int, Rollouts]:
        """Shards of iteration ``t``, waiting for the expected ones at most ``rollout_timeout_s`` and
        not for those of peers the swarm no longer lists."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.plan.rl.rollout_timeout_s
        async with self._changed:
            while not self.intake.complete(t) and (left := deadline - loop.time()) > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, GONE_CHECK_S)):
                        await self._changed.wait_for(lambda: self.intake.complete(t))
                gone = {p for p in map(str, self.peers) if self._gone(p)}
                if gone and (owed := self.intake.give_up(t, gone)):
                    log.warning(
                        "rl job %s: iteration %d: shards %s not waited for: %s left the swarm",
                        self.plan.job_id,
                        t,
                        owed,
                        ", ".join(sorted({self.intake.peers[s] for s in owed})),
                    )
        shards, missing = self.intake.close(t)
        if missing:
            log.warning(
                "rl job %s: iteration %d: no shard %s within %g s, dropped",
                self.plan.job_id,
                t,
                missing,
                self.plan.rl.rollout_timeout_s,
            )
        return shards

    def _groups(self, t: int, shards: dict[int, Rollouts]) -> list[RolloutGroup]:
        out = []
        for msg in shards.values():
            lag = t - msg.version
            assert 0 <= lag <= self.plan.rl.staleness, "checked on arrival"
            for g in msg.groups:
                out.append(
                    RolloutGroup(self.plan.problem(t, g.problem), g.completions, g.logprobs, msg.version)
                )
                self.staleness[lag] += len(g.completions)
        return out

    async def run(self) -> list[IterationReport]:
        """Every iteration of the job (after ``start``); ``done`` is announced at the end.

        Cancelling it stops it while it waits for shards; an iteration whose shards are in is
        finished first (trained, published, reported), so the policy, its version and the reports
        always agree; data-parallel trainers give it ``STOP_GRACE_S``, then abort its averaging
        (the learner is then ``torn``: no version's policy).
        """
        for t in range(self.iteration, self.plan.iterations):
            began = time.perf_counter()
            missing_before = self.missing_shards
            absent_before = set(self.intake.absent)
            shards = await self._collect(t)  # shards of t arriving from now on are late
            covered = [s for s in sorted(absent_before) if s not in shards and self.shards[s]]
            covered = covered if self.config.cover_absent else []
            shards = await self._sample_here(t, shards, sorted({*self.own_shards, *covered} - set(shards)))
            self.covered_shards += len(covered)
            counts = (self.missing_shards - missing_before, len(covered))
            step = asyncio.ensure_future(self._iterate(t, shards, began, counts))
            try:
                await asyncio.shield(step)
            except asyncio.CancelledError:
                done, _ = await asyncio.wait([step], timeout=STOP_GRACE_S)
                if not done and self.group is not None:
                    # another trainer is gone mid-iteration: stop averaging (the policy is torn, the
                    # next trainer resumes from a checkpoint) instead of waiting out the group's timeout
                    await self.group.close()
                await asyncio.wait([step])
                if not step.cancelled() and step.exception() is not None:
                    log.info("rl job %s: iteration %d stopped: %s", self.plan.job_id, t, step.exception())
                raise
        async with self._changed:
            self.intake.done = True
            self._changed.notify_all()
        return self.reports

    async def _sample_here(self, t: int, shards: dict[int, Rollouts], todo: list[int]) -> dict[int, Rollouts]:
        """Sample shards ``todo`` of iteration ``t`` here, with the policy of version ``t`` and each
        shard's own generator: exactly what a rollout peer would have sent."""
        if not todo:
            return shards
        version, policy = self.learner.version, self.learner.policy

        def sample() -> list[Rollouts]:
            out = []
            for s in todo:
                indices, began = self.shards[s], time.perf_counter()
                groups = sample_shard(policy, self.plan, t, s, indices, version)
                wire = to_wire([(i, g.completions, g.logprobs) for i, g in zip(indices, groups, strict=True)])
                took = time.perf_counter() - began
                out.append(Rollouts(iteration=t, shard=s, version=version, groups=wire, sample_s=took))
            return out

        made = await _in_thread(sample)
        return dict(sorted({**shards, **{m.shard: m for m in made}}.items()))

    async def _iterate(
        self, t: int, shards: dict[int, Rollouts], began: float, counts: tuple[int, int]
    ) -> None:
        """Score, train, publish, checkpoint and report iteration ``t`` on its ``shards``."""
        plan = self.plan
        interval = plan.spec.checkpoint_interval
        waited = time.perf_counter()
        groups = self._groups(t, shards)
        lags: Counter[int] = Counter()
        for m in shards.values():
            lags[t - m.version] += sum(len(g.completions) for g in m.groups)
        tokens = sum(len(c) for g in groups for c in g.completions)
        await _small_inline(tokens, INLINE_TOKENS, score, plan.task, groups)
        scored = time.perf_counter()
        rewards, rollouts = summarize(groups), sum(g.size for g in groups)
        pooled = None
        if self.group is not None and self.average is not None:  # every trainer's groups, the same on each
            pooled = PooledRewards(self.average, rewards, rollouts, self.group.size)
        figures = await _in_thread(self.learner.train, groups, None, pooled)
        if pooled is not None:
            rewards, rollouts = pooled.result()
        trained = time.perf_counter()
        await self._publish()
        published = time.perf_counter()
        last = t + 1 == plan.iterations
        if self.config.checkpoint_root is not None and (last or (interval and (t + 1) % interval == 0)):
            await _in_thread(self.save_checkpoint)
        done = time.perf_counter()
        served = self.weight_sync_bytes
        averaged = self.group.bytes_sent() if self.group is not None else (0, 0)
        report = IterationReport.of(
            iteration=t,
            version=self.learner.version,
            kl=figures.kl,
            loss=figures.loss,
            clip_fraction=figures.clip_fraction,
            rollouts=rollouts,
            updates=figures.updates,
            shards=len(shards),
            shards_missing=counts[0],
            shards_covered=counts[1],
            staleness=dict(sorted(lags.items())),
            dropped_stale=self.dropped_stale - self._stale_seen,
            dropped_late=self.dropped_late - self._late_seen,
            weight_sync_bytes=served - self._bytes_seen,
            averaging_bytes=averaged[0] - self._averaged_seen[0],
            averaging_raw_bytes=averaged[1] - self._averaged_seen[1],
            seconds={
                **generation_seconds(shards),
                "wait": waited - began,
                "score": scored - waited,
                "reference": figures.reference_s,
                "train": trained - scored - figures.reference_s,
                **(
                    {
                        "average": figures.average_s,
                        "average_wait": max(0.0, self.group.waited_s() - self._waited_seen),
                    }
                    if self.group is not None
                    else {}
                ),
                "publish": published - trained,
                "checkpoint": done - published,
            },
            rollouts_per_s=rollouts / max(done - began, 1e-9),
            rewards=rewards,
        )
        self._stale_seen, self._late_seen, self._bytes_seen = (
            self.dropped_stale,
            self.dropped_late,
            served,
        )
        self._averaged_seen = averaged
        self._waited_seen = self.group.waited_s() if self.group is not None else 0.0
        self.reports.append(report)
        log.info(
            "rl job %s: iteration %d: reward %.3f pass %.3f kl %.4f, %d rollouts of %d shards (%d missing)",
            plan.job_id,
            t,
            report.reward_mean,
            report.pass_rate,
            report.kl,
            report.rollouts,
            report.shards,
            report.shards_missing,
        )
        if self.on_iteration is not None:
            self.on_iteration(report)

    async def farewell(self, timeout_s: float) -> bool:
        """Keep serving until every rollout peer still expected heard ``done``, at most ``timeout_s``."""
        try:
            async with self._changed, asyncio.timeout(timeout_s):
                await self._changed.wait_for(
                    lambda: {self.intake.peers[s] for s in self.intake.expected()} <= self.told
                )
            return True
        except TimeoutError:
            return False

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        assert self.config.checkpoint_root is not None
        directory = checkpoint.tasklet_dir(self.config.checkpoint_root, self.plan.job_id, 0, 0)
        return checkpoint.save(directory, self.learner.checkpoint_state())
