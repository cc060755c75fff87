"""Jobs inside a daemon: builds the ``JobManager`` from the daemon's parts and names its control methods.

The daemon hands over its DHT, identity, transport and three live readings (its device
profile, its link measurements, the peers table); this module turns them into what the
planner and the runner need (consensus roster profiles and links, the online peers, a
runner per job this peer takes part in: a ``TaskletRunner``, or an ``RLRunner`` for an rl job) so
``daemon.py`` only wires.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from peerd.errors import ConfigError
from peerd.jobs import catalog
from peerd.jobs.fetch import assemble, gather
from peerd.jobs.manager import JobManager, ManagerConfig
from peerd.jobs.records import JobRecord
from peerd.jobs.rl.runner import RLRunner
from peerd.jobs.roles import JobRunner
from peerd.jobs.runner import TaskletRunner, state_bound
from peerd.jobs.spec import JobSpec
from peerd.jobs.store import DhtStore
from peerd.pipeline.replicas import CheckpointReplicas
from peerd.sched.consensus.messages import RosterDevice, RosterLink
from peerd.swarm.node import parse_peer_id
from peerd.swarm.records import DeviceProfile, LinkMeasurement, LinkStatus, PeerRecord, PeerState, scaled
from peerd.swarm.transport import Transport
from peerd.wire.types import ElementCosts

REPLICA_BUDGET_BYTES = 4 << 30  # disk for other stages' checkpoint copies, over all jobs

# control method -> (JobManager attribute, help shown by the ``methods`` call)
METHODS: dict[str, tuple[str, str]] = {
    "submit": (
        "submit",
        "Validate a job spec, sign it with this peer's key and publish it; returns the job id.",
    ),
    "cancel": ("cancel", "Cancel a job this peer owns (NOT_OWNER for anybody else's)."),
    "jobs": ("list_jobs", "The jobs of this swarm: state, allocation, progress."),
    "job_status": ("job_status", "One job in detail: planning, committed allocation, progress, tasklets."),
    "fetch": (
        "fetch",
        "Gather a job's newest checkpoint of every stage from the peers that hold it (p2p) and "
        "assemble it into OUT/model.pt.",
    ),
}
SERVICE_METHODS = {"fetch"}  # served by JobService itself (it holds the transport), not the manager


def roster_profile(profile: DeviceProfile | None, region: str) -> RosterDevice:
    """What this peer tells a roster about its device: fp32 TFLOPS (what training runs), usable memory,
    memory bandwidth (bytes/s) and seconds per dispatched op (when its profile measured them), and a
    CPU device's machine, cores and threads (when its profile has all three) with what a message
    costs that machine and the cores its daemon keeps busy idle (when measured)."""
    if profile is None:
        return RosterDevice(0.0, 0, region)
    tflops = profile.tflops.get("fp32") or max(profile.tflops.values(), default=0.0)
    memory = (
        profile.memory_free_bytes if profile.memory_free_bytes is not None else profile.memory_total_bytes
    )
    shared = None not in (profile.host_id, profile.host_cores, profile.threads)
    return RosterDevice(
        round(float(tflops), 6),
        int(memory),
        region,
        scaled(profile.memory_gb_s, 1e9),
        scaled(profile.launch_us, 1e-6),
        profile.host_id if shared else None,
        profile.host_cores if shared else None,
        profile.threads if shared else None,
        _seconds(profile.element_ns),
        scaled(profile.message_us, 1e-6) if shared else None,
        scaled(profile.wire_byte_ns, 1e-9) if shared else None,
        profile.idle_cores if shared else None,
        scaled(profile.codec_us, 1e-6) if shared else None,
        scaled(profile.codec_value_ns, 1e-9) if shared else None,
    )


def _seconds(ns: ElementCosts | None) -> ElementCosts | None:
    """A profile's element costs (ns per unit) in the roster's seconds."""
    if ns is None:
        return None
    return ElementCosts(**{k: v * 1e-9 for k, v in msgspec.structs.asdict(ns).items()})


def roster_links(measurements: list[LinkMeasurement], peers: set[str]) -> tuple[RosterLink, ...]:
    """Successful probes to current peers as one-way delay (RTT / 2) and upload bandwidth, sorted by peer."""
    out = {}
    for m in measurements:
        rtt, up = m.rtt_s, m.bw_up_bps
        if m.status != LinkStatus.OK or m.peer_id not in peers or not up or rtt is None:
            continue
        out[m.peer_id] = RosterLink(m.peer_id, round(rtt / 2, 9), round(up, 3))
    return tuple(out[p] for p in sorted(out))


class JobService:
    """The daemon's job manager; ``run()`` as a supervised loop, ``call(method, params)`` from the control socket."""

    def __init__(
        self,
        *,
        dht: Any,
        owner_tag: bytes,
        peer_id: str,
        clock: Callable[[], float],
        swarm: str,
        transport: Transport,
        home: Path,
        region: str,
        profile: Callable[[], DeviceProfile | None],
        links: Callable[[], list[LinkMeasurement]],
        peers: Callable[[], list[PeerRecord]],
        config: ManagerConfig | None = None,
        device: str = "auto",
    ) -> None:
        self.store = DhtStore(dht, owner_tag, peer_id, clock)
        self.device = device  # the daemon's --device: where this peer's tasklets compute
        self.transport, self.region = transport, region
        self.checkpoints = home / "checkpoints"
        # other stages' checkpoints this peer keeps for the swarm (a stage's peers may all vanish)
        self.replicas = CheckpointReplicas(home / "replicas", budget_bytes=REPLICA_BUDGET_BYTES)
        self._profile, self._links, self._peers = profile, links, peers
        self.manager = JobManager(
            self.store,
            swarm,
            local=self.local,
            online=self.online,
            runner_factory=self.make_runner,
            config=config,
        )

    def online(self) -> list[str]:
        return [r.peer_id for r in self._peers() if r.state == PeerState.ONLINE and r.profile is not None]

    def local(self) -> tuple[RosterDevice, tuple[RosterLink, ...]]:
        return roster_profile(self._profile(), self.region), roster_links(self._links(), set(self.online()))

    def make_runner(self, job: JobRecord, spec: JobSpec) -> JobRunner:
        common: dict[str, Any] = {
            "store": self.store,
            "transport": self.transport,
            "peer_ref": parse_peer_id,
            "checkpoint_root": self.checkpoints,
            "replicas": self.replicas,
            "device": self.device,
        }
        if spec.kind == "rl":  # a trainer stops waiting for a rollout peer the swarm no longer lists
            return RLRunner(job, spec, online=self.online, **common)
        return TaskletRunner(job, spec, **common)

    async def run(self) -> None:
        await self.manager.run()

    async def close(self) -> None:
        await self.manager.close()

    def handler(self, method: str) -> Callable[[dict[str, Any]], Awaitable[Any]]:
        owner = self if method in SERVICE_METHODS else self.manager
        return getattr(owner, METHODS[method][0])

    async def fetch(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params``: ``job_id``, ``out`` (a directory on this machine). Checkpoints over p2p, then ``assemble``."""
        out = params.get("out")
        if not isinstance(out, str) or not out:
            raise ConfigError("out", "give the directory to write model.pt into")
        entry = await self.manager.find(params.get("job_id"))
        rec, spec = entry.record, entry.spec
        commit = entry.commit or await catalog.read_commit(self.store, rec.job_id)
        if commit is None:
            raise ConfigError("job_id", f"job {rec.job_id} has no committed allocation yet: nothing to fetch")
        done = min((p.step for p in entry.progress.values() if p.epoch == commit.epoch), default=0)
        every = spec.checkpoint_interval or spec.steps
        steps = sorted(
            {spec.steps if done >= spec.steps else 0, *range(done // every * every, 0, -every)}, reverse=True
        )
        steps = [s for s in steps if s > 0][:4]  # the newest few: older ones are pruned everywhere
        runner = entry.runner
        with tempfile.TemporaryDirectory(
            prefix=".fetch-", dir=Path(out).parent if Path(out).parent.is_dir() else None
        ) as tmp:
            step, sources = await gather(
                self.transport,
                parse_peer_id,
                rec.job_id,
                commit.allocation,
                steps,
                Path(tmp),
                me=self.store.me,
                max_bytes=state_bound(spec),
                local=runner.provide if runner is not None else None,
            )
            result = await asyncio.to_thread(assemble, rec.job_id, spec, [Path(tmp)], Path(out))
        return {
            "path": str(result.path),
            "step": step,
            "stages": result.stages,
            "parameters": result.parameters,
            "sources": {str(k): v for k, v in sources.items()},
        }

    def views(self) -> list[dict[str, Any]]:
        return self.manager.views(detail=True)
