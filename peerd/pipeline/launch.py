"""Run a fixed placement (stages × replicas → peers) of a pipeline job on loopback peers, in one process.

Each peer is its own hivemind P2P (a real p2pd) with its own Transport; every tasklet is a
``StageWorker``. The start is a ready handshake, never a sleep: all workers serve their stage
protocol first, then all connect to their neighbours, then all train. Links between
pipeline neighbours can be shaped (bandwidth, delay) while links inside a replica group stay
as they are. Gradient averaging is injected as a ``ReducerFactory`` (``peerd.averaging`` sits
beside this package, so the composition happens in the caller: tests, scripts, benchmarks,
the job runner). ``peerd.pipeline.processes`` runs the same placement as one OS process per
peer. A ``Placement`` names launched peers by index; the daemon's jobs run an agreed
``peerd.sched.allocation.Allocation`` of peer ids instead (``peerd.jobs.runner``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from peerd.errors import ConfigError, PeerdError
from peerd.log import get_logger
from peerd.pipeline import checkpoint
from peerd.pipeline.config import TrainConfig
from peerd.pipeline.streams import PeerRef
from peerd.pipeline.worker import Reducer, StageWorker, StepReport
from peerd.swarm.shaper import LinkShaper, LinkSpec
from peerd.swarm.transport import Transport, create_p2p
from peerd.tasks import within

logger = get_logger(__name__)

# (transport, the stage's replica peers in replica order, this peer, group key, config) -> reducer
ReducerFactory = Callable[[Transport, list[PeerRef], PeerRef, str, TrainConfig], Reducer]
Prepare = Callable[[list["StageWorker"]], Awaitable[None] | None]


@dataclass(frozen=True)
class Placement:
    """Which launched peer runs each tasklet: ``peers[stage][replica]`` is an index into the launched peers."""

    peers: list[list[int]]

    @classmethod
    def grid(cls, stages: int, replicas: int) -> Placement:
        """Peer ``stage * replicas + replica`` runs tasklet (stage, replica)."""
        return cls([[s * replicas + r for r in range(replicas)] for s in range(stages)])

    @property
    def stages(self) -> int:
        return len(self.peers)

    @property
    def replicas(self) -> int:
        return len(self.peers[0]) if self.peers else 0

    def tasklets(self) -> Iterator[tuple[int, int, int]]:
        """(stage, replica, peer index) of every tasklet."""
        for s, row in enumerate(self.peers):
            for r, peer in enumerate(row):
                yield s, r, peer

    def tasklet_of(self, peer: int) -> tuple[int, int]:
        """(stage, replica) that launched peer ``peer`` runs."""
        for s, r, p in self.tasklets():
            if p == peer:
                return s, r
        raise ConfigError("allocation", f"peer {peer} runs no tasklet")

    def validate(self, cfg: TrainConfig, num_peers: int) -> None:
        if self.stages != cfg.num_stages:
            raise ConfigError("allocation", f"{self.stages} stages allocated, the job has {cfg.num_stages}")
        if any(len(row) != self.replicas for row in self.peers) or self.replicas < 1:
            raise ConfigError("allocation", "every stage needs the same number (>= 1) of replicas")
        used = [p for _, _, p in self.tasklets()]
        if len(set(used)) != len(used) or not all(0 <= p < num_peers for p in used):
            raise ConfigError("allocation", f"peers must be distinct indices in 0..{num_peers - 1}")
        cfg.replica_batch(self.replicas)

    def neighbour_pairs(self) -> set[frozenset[int]]:
        """Peer index pairs that exchange activations (the links a WAN emulation slows down)."""
        return {
            frozenset((self.peers[s][r], self.peers[s + 1][r]))
            for s in range(self.stages - 1)
            for r in range(self.replicas)
        }


@dataclass
class LocalPeer:
    index: int
    p2p: Any
    transport: Transport

    @property
    def peer_id(self) -> PeerRef:
        return self.p2p.peer_id


async def start_peers(
    count: int, *, link: LinkSpec | None = None, shaped: set[frozenset[int]] | None = None
) -> list[LocalPeer]:
    """``count`` loopback peers, each with its own p2pd; later peers bootstrap from all earlier ones.

    With ``link``, traffic between the index pairs in ``shaped`` (default: all pairs) is paced
    to that bandwidth and delay in both directions.
    """
    peers: list[LocalPeer] = []
    index_of: dict[PeerRef, int] = {}
    try:
        for i in range(count):
            maddrs = [m for p in peers for m in await p.p2p.get_visible_maddrs()]
            p2p = await create_p2p(maddrs)
            shaper = None
            if link is not None:
                shaper = LinkShaper(_resolver(i, link, shaped, index_of))
            peers.append(LocalPeer(i, p2p, Transport(p2p, shaper)))
            index_of[p2p.peer_id] = i
    except BaseException:
        await stop_peers(peers)
        raise
    return peers


def _resolver(
    me: int, link: LinkSpec, shaped: set[frozenset[int]] | None, index_of: dict[PeerRef, int]
) -> Callable[[Any], LinkSpec | None]:
    def resolve(peer: Any) -> LinkSpec | None:
        other = index_of.get(peer)
        if other is None:
            return None
        return link if shaped is None or frozenset((me, other)) in shaped else None

    return resolve


async def stop_peers(peers: list[LocalPeer]) -> None:
    """Close every transport, then every p2pd (in reverse start order); never raises."""
    for peer in reversed(peers):
        with contextlib.suppress(Exception):
            await within(peer.transport.close(), 10)
    for peer in reversed(peers):
        with contextlib.suppress(Exception):
            await within(peer.p2p.shutdown(), 10)


@dataclass
class TaskletError:
    stage: int
    replica: int
    code: str
    message: str


@dataclass
class RunResult:
    """Reports of every tasklet, the errors of failed ones, and the step the run started at."""

    start_step: int
    reports: list[StepReport] = field(default_factory=list)
    errors: list[TaskletError] = field(default_factory=list)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)  # "s0r1" -> stream counters

    @property
    def ok(self) -> bool:
        return not self.errors

    def losses(self) -> list[float]:
        """Loss of every completed step: the mean of the last stage's replica losses (the global batch mean)."""
        by_step: dict[int, list[float]] = {}
        for r in self.reports:
            if r.loss is not None:
                by_step.setdefault(r.step, []).append(r.loss)
        replicas = max((len(v) for v in by_step.values()), default=0)
        return [sum(v) / len(v) for _, v in sorted(by_step.items()) if len(v) == replicas]

    def step_times(self) -> list[float]:
        """Per step: the slowest tasklet's step time (what the job sees)."""
        by_step: dict[int, float] = {}
        for r in self.reports:
            by_step[r.step] = max(by_step.get(r.step, 0.0), r.step_s)
        return [t for _, t in sorted(by_step.items())]


def build_workers(
    cfg: TrainConfig,
    placement: Placement,
    peers: list[LocalPeer],
    *,
    reducer_factory: ReducerFactory | None = None,
    on_report: Callable[[StepReport], None] | None = None,
    here: set[int] | None = None,
) -> list[StageWorker]:
    """One StageWorker per tasklet (only those of the peers in ``here``, if given), wired to its
    allocated neighbours and replica group."""
    cfg.validate()
    placement.validate(cfg, len(peers))
    if placement.replicas > 1 and reducer_factory is None:
        raise ConfigError("allocation", "replicas > 1 need a reducer_factory (gradient averaging)")
    workers = []
    for s, r, p in placement.tasklets():
        if here is not None and p not in here:
            continue
        peer = peers[p]
        group = [peers[q].peer_id for q in placement.peers[s]]
        reducer = None
        if placement.replicas > 1:
            assert reducer_factory is not None
            reducer = reducer_factory(peer.transport, group, peer.peer_id, f"{cfg.job}/s{s}", cfg)
        workers.append(
            StageWorker(
                cfg,
                stage=s,
                replica=r,
                replicas=placement.replicas,
                transport=peer.transport,
                upstream=peers[placement.peers[s - 1][r]].peer_id if s > 0 else None,
                downstream=peers[placement.peers[s + 1][r]].peer_id if s + 1 < placement.stages else None,
                reducer=reducer,
                on_report=on_report,
            )
        )
    return workers


def resume_step(cfg: TrainConfig, placement: Placement) -> int | None:
    """The newest step every tasklet has a checkpoint of (None: start from scratch)."""
    if cfg.checkpoint_dir is None:
        return None
    return checkpoint.common_step(cfg.checkpoint_dir, cfg.job, ((s, r) for s, r, _ in placement.tasklets()))


async def run_workers(
    workers: list[StageWorker],
    *,
    until: int | None = None,
    resume: int | None = None,
    prepare: Prepare | None = None,
) -> RunResult:
    """Restore (optionally), serve, connect, train and close ``workers``; typed failures become ``errors``."""
    start = 0
    try:
        if resume is not None:
            for w in workers:
                start = w.restore(resume)
        await asyncio.gather(*(w.start() for w in workers))  # everyone serves ...
        await asyncio.gather(*(w.connect() for w in workers))  # ... before anyone connects
        if prepare is not None:  # e.g. a test injecting frames between the handshake and training
            pending = prepare(workers)
            if inspect.isawaitable(pending):
                await pending
        outcomes = await asyncio.gather(*(w.run(until) for w in workers), return_exceptions=True)
    finally:
        await asyncio.gather(*(w.close() for w in workers))
    result = RunResult(start_step=start)
    for w, outcome in zip(workers, outcomes, strict=True):
        result.stats[f"s{w.stage}r{w.replica}"] = w.stats.snapshot()
        result.reports.extend(w.reports)
        if isinstance(outcome, PeerdError):
            result.errors.append(TaskletError(w.stage, w.replica, outcome.code.name, outcome.message))
        elif isinstance(outcome, BaseException):
            raise outcome  # a bug, not a network or input failure
    result.reports.sort(key=lambda r: (r.step, r.stage, r.replica))
    return result


async def run_allocation(
    cfg: TrainConfig,
    placement: Placement,
    peers: list[LocalPeer],
    *,
    reducer_factory: ReducerFactory | None = None,
    until: int | None = None,
    resume: bool = False,
    on_report: Callable[[StepReport], None] | None = None,
    prepare: Prepare | None = None,
) -> RunResult:
    """Train ``cfg`` on ``peers`` as ``placement`` says; with ``resume`` continue from the newest common checkpoint."""
    step = resume_step(cfg, placement) if resume else None
    if resume and step is None:
        logger.info("no common checkpoint for job %s: starting from step 0", cfg.job)
    workers = build_workers(cfg, placement, peers, reducer_factory=reducer_factory, on_report=on_report)
    return await run_workers(workers, until=until, resume=step, prepare=prepare)
