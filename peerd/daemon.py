"""The peerd daemon lifecycle: start the swarm services in order, run until told to stop, shut down in reverse.

Startup: control endpoint (also the "this home is in use" lock) -> swarm node
(p2pd + DHT, bootstrapped through the initial peers and the peers remembered in
HOME/known_peers.json, which the membership loop keeps current) -> transport and probe responder -> announcer (JOINING) and the
membership reader -> device profile -> ONLINE -> link prober -> jobs (``peerd.jobs``:
discovery, planning, tasklets) -> metrics endpoint (opt-in). Shutdown runs the
same list backwards within ``shutdown_timeout``: metrics, jobs, prober, announcer (publishes
OFFLINE), reader, transport, node (stops p2pd), control endpoint; whatever is
still alive at the deadline is killed. A leave (``peerd leave``, SIGTERM, SIGINT)
first hands this peer's tasklets over, for at most ``leave_grace_s``, and then
shuts down; a second signal skips what is left of both grace periods; the
previous handlers are restored afterwards. ``peerd pause``/``resume`` stop and
restart training here without leaving the swarm. SIGUSR1 logs the stack of every task
and thread (a diagnosis of a daemon that seems stuck). Background loops are supervised:
an error is logged and the loop restarts, so bad input from the network never
ends the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import torch

from peerd import __version__
from peerd.config import DaemonConfig
from peerd.control import ControlServer, number_param, text_param
from peerd.errors import ConfigError, ErrorCode, PeerdError, PeerUnavailable
from peerd.jobs.manager import JobManager, ManagerConfig
from peerd.jobs.service import METHODS as JOB_METHODS
from peerd.jobs.service import JobService
from peerd.log import get_logger
from peerd.metrics import MetricsServer
from peerd.swarm.access import access_mode, access_validators
from peerd.swarm.bans import BanPolicy
from peerd.swarm.faults import FAULT_INJECTION_ENV, Cut, fault_injection_enabled
from peerd.swarm.host import IdleLoad
from peerd.swarm.identity import Identity, make_record_validators
from peerd.swarm.links import LinkProber, ProbeConfig, ProbeResponder
from peerd.swarm.membership import (
    KNOWN_PEERS_FILE,
    Announcer,
    KnownPeer,
    KnownPeersStore,
    PeerEntry,
    bootstrap_peers,
    fetch_peers,
    merge_peer_entries,
    peers_view,
)
from peerd.swarm.node import NodeSettings, SwarmNode, parse_peer_id
from peerd.swarm.profiling import with_live_memory
from peerd.swarm.records import DeviceProfile, PeerRecord, PeerState, fit_peer_record
from peerd.swarm.rejections import Refusals, by_name
from peerd.swarm.shaper import LinkShaper
from peerd.swarm.transport import Transport
from peerd.tasks import cancel_and_wait, stacks, within

logger = get_logger(__name__)

RECONNECT_S = 30.0  # how often remembered peers out of sight are pinged (at least a record TTL)
MAX_CUT_PEERS = 1024

READY_PREFIX = "PEERD_READY "
RESTART_BACKOFF_S = (1.0, 30.0)  # supervised loops restart after min(2^n, 30) s
DRAIN_SLACK_S = 5.0  # beyond a leave's grace period, before the hand-over is cut short


@dataclass(frozen=True)
class ReadyInfo:
    """What the daemon tells its launcher once it is ONLINE (one JSON line on stdout)."""

    peer_id: str
    name: str
    swarm: str
    maddrs: list[str]
    control_socket: str
    home: str
    pid: int


def format_ready_line(info: ReadyInfo) -> str:
    return READY_PREFIX + json.dumps(asdict(info), sort_keys=True)


def parse_ready_line(line: str) -> ReadyInfo | None:
    """The ``ReadyInfo`` in a line printed by ``peerd join``, or None if the line is something else."""
    if not line.startswith(READY_PREFIX):
        return None
    try:
        return ReadyInfo(**json.loads(line[len(READY_PREFIX) :]))
    except (ValueError, TypeError):
        return None


class Daemon:
    """One peer: ``await start()``, ``await wait_stopped()``, ``await stop()`` (or ``run_daemon``)."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config.resolved()
        self.state = PeerState.JOINING
        self.identity: Identity | None = None
        self.node: SwarmNode | None = None
        self.transport: Transport | None = None
        self.responder: ProbeResponder | None = None
        self.prober: LinkProber | None = None
        self.announcer: Announcer | None = None
        self.profile: DeviceProfile | None = None  # measured in start(), off the event loop
        self.idle_load = IdleLoad()  # sampled as records are built; priced where daemons share cores
        self.entries: dict[str, PeerEntry] = {}  # peer id -> latest validated record
        assert self.config.home is not None  # resolved() fills every path
        # the peers seen, kept in the home: the next start bootstraps through them too
        self.known_peers = KnownPeersStore(self.config.home / KNOWN_PEERS_FILE, self.config.swarm)
        self.control = ControlServer(self.config.control_socket)  # type: ignore[arg-type]
        self._tasks: dict[str, asyncio.Task] = {}
        self._stop_requested = asyncio.Event()
        self._hurry = asyncio.Event()
        self._probe_wake = asyncio.Event()
        self._started_at = 0.0
        self._stopped = False
        self._leave_grace_s: float | None = None  # set by a leave: the stop hands work over first
        self.failure: str | None = None  # why the daemon stopped by itself, if it did
        self.control.register("status", self._rpc_status, "This peer, the peers table and the link matrix.")
        self.control.register(
            "shutdown", self._rpc_shutdown, "Stop now: announce OFFLINE and exit without handing work over."
        )
        self.control.register(
            "leave", self._rpc_leave, "Hand this peer's tasklets over (at most grace_s seconds), then exit."
        )
        self.control.register("pause", self._rpc_pause, "Stop training here and take no work until resume.")
        self.control.register("resume", self._rpc_resume, "Take work again after a pause.")
        self.control.register(
            "partition",
            self._rpc_partition,
            f"Fault injection (only with {FAULT_INJECTION_ENV}=1): cut this peer off from peers for seconds.",
        )
        self.jobs: JobService | None = None  # submit/cancel/planning/training: peerd.jobs
        self.metrics: MetricsServer | None = None
        self._dht_rejected: dict[str, int] = {}  # peerd.swarm.rejections, as the DHT process last said
        for method, (_, doc) in JOB_METHODS.items():
            self.control.register(method, self._job_method(method), doc)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> ReadyInfo:
        """Bring every component up; on failure, whatever started is stopped before the error propagates."""
        cfg = self.config
        try:
            assert cfg.home is not None and cfg.identity is not None
            cfg.home.mkdir(parents=True, exist_ok=True, mode=0o700)
            await self.control.start()
            from peerd.swarm.profiling import resolve_device

            resolve_device(cfg.device)  # a device that does not exist fails before p2pd starts
            _set_threads(cfg.threads)
            self.identity = Identity.load_or_create(cfg.identity)
            if cfg.allowed_peers and self.identity.peer_id not in cfg.allowed_peers:
                raise ConfigError(
                    "allowed_peers",
                    f"does not list this peer's own id {self.identity.peer_id}: its own records would be refused",
                )
            self.node = await self._start_node(self.known_peers.load())
            self._started_at = self.node.now()

            self.transport = Transport(
                self.node.p2p,
                shaper=self._make_shaper(),
                ban_policy=BanPolicy(ban_s=cfg.ban_s, max_ban_s=3600.0),
            )
            if cfg.swarm_secret_file is not None or cfg.allowed_peers:  # members only
                self.transport.admit = self._admits
            probe_config = ProbeConfig(peers_per_refresh=max(1, cfg.probe_budget))
            # while it works for a job it spares its links the bulk probes of peers that hold figures
            self.responder = ProbeResponder(
                self.transport,
                probe_config,
                working=lambda: self.jobs is not None and self.jobs.manager.holds_work,
                serving=self._not_upkeep,
            )
            await self.responder.start()
            self.prober = LinkProber(self.transport, probe_config)

            self.announcer = Announcer(
                self.node.dht,
                swarm=cfg.swarm,
                owner_tag=self.identity.owner_tag,
                build=self._build_record,
                ttl=cfg.record_ttl,
                interval=cfg.refresh_interval,
            )
            self._spawn("announce", self.announcer.run)
            self._spawn("membership", self._read_loop)

            self.profile = await asyncio.get_running_loop().run_in_executor(None, self._measure_profile)
            self.state = PeerState.ONLINE
            self.announcer.state = PeerState.ONLINE
            # publish before reporting ready, so "ready" means "listed ONLINE" (the loop retries if this fails)
            with contextlib.suppress(Exception):
                await self.announcer.publish(timeout=cfg.refresh_interval)
            if cfg.probe_budget > 0:
                self._spawn("probe", self._probe_loop)
            self.jobs = JobService(
                dht=self.node.dht,
                owner_tag=self.identity.owner_tag,
                peer_id=self.node.peer_id,
                clock=self.node.now,
                swarm=cfg.swarm,
                transport=self.transport,
                home=cfg.home,
                region=cfg.region,
                profile=self._live_profile,
                links=lambda: list(self.prober.measurements.values()) if self.prober else [],
                peers=self._live_records,
                config=ManagerConfig(max_jobs=cfg.max_jobs),
                device=cfg.device,
            )
            self._spawn("jobs", self.jobs.run)
            if cfg.metrics_port:
                self.metrics = MetricsServer(cfg.metrics_port, self._view, refresh=self._refresh_refusals)
                await self.metrics.start()
        except BaseException:
            await self.stop()
            raise
        info = ReadyInfo(
            peer_id=self.node.peer_id,
            name=cfg.name,
            swarm=cfg.swarm,
            maddrs=list(self.node.maddrs),
            control_socket=str(cfg.control_socket),
            home=str(cfg.home),
            pid=os.getpid(),
        )
        logger.info("peer %s (%s) is ONLINE in swarm %r", info.name, info.peer_id, info.swarm)
        return info

    def request_stop(self) -> None:
        self._stop_requested.set()

    def request_leave(self, grace_s: float | None = None) -> float:
        """Stop, handing this peer's tasklets over first for at most ``grace_s`` (default ``leave_grace_s``).

        Returns the grace period that applies: the first leave's, if one was already asked for.
        """
        if self._leave_grace_s is None and not self._stopped:
            self._leave_grace_s = self.config.leave_grace_s if grace_s is None else grace_s
            logger.info("leaving: handing this peer's work over for at most %.0f s", self._leave_grace_s)
        self.request_stop()
        return self._leave_grace_s or 0.0

    @property
    def leaving(self) -> bool:
        return self._leave_grace_s is not None

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    async def wait_stopped(self) -> None:
        await self._stop_requested.wait()

    def hurry(self) -> None:
        """Cut a running graceful shutdown short (second Ctrl-C)."""
        self._hurry.set()

    async def stop(self) -> None:
        """Shut down in reverse start order within ``shutdown_timeout`` (or until ``hurry()``), then kill the rest."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_requested.set()
        if self._leave_grace_s is not None:
            await self._drain(self._leave_grace_s)
        steps = asyncio.create_task(self._shutdown_steps())
        hurry = asyncio.create_task(self._hurry.wait())
        try:
            await asyncio.wait(
                {steps, hurry}, timeout=self.config.shutdown_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            hurry.cancel()
        if not steps.done():
            logger.warning("graceful shutdown cut short; killing what is left")
            await cancel_and_wait(steps)
            await self._kill_rest()
        elif steps.exception() is not None:
            logger.error("a shutdown step failed", exc_info=steps.exception())
            await self._kill_rest()
        logger.info("peer %s stopped", self.config.name)

    async def _drain(self, grace_s: float) -> None:
        """Hand this peer's tasklets over before shutting down; bounded by ``grace_s``, cut short by ``hurry()``."""
        if self.jobs is None:
            return
        drain = asyncio.create_task(self.jobs.manager.drain(grace_s), name="peerd-drain")
        hurry = asyncio.create_task(self._hurry.wait())
        try:
            # the manager keeps to grace_s itself; the slack lets it publish its last records
            await asyncio.wait(
                {drain, hurry}, timeout=grace_s + DRAIN_SLACK_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            hurry.cancel()
        if not drain.done():
            logger.warning("handing work over did not finish within %.0f s; shutting down anyway", grace_s)
            await cancel_and_wait(drain)
        elif drain.exception() is not None:
            logger.error("handing work over failed; shutting down anyway", exc_info=drain.exception())
        else:
            logger.info("handed this peer's work over")

    async def _kill_rest(self) -> None:
        if self.node is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.node.kill)
        await self.control.close()

    async def _shutdown_steps(self) -> None:
        cfg = self.config
        if self.metrics is not None:
            await self.metrics.close()
        await self._cancel("jobs")  # stops planners and tasklets (their final progress is published)
        for name in ("probe", "membership"):
            await self._cancel(name)
        if self.announcer is not None:
            await self._cancel("announce")
            if self.announcer.seq > 0:  # only a peer that announced itself needs to say goodbye
                self.state = PeerState.OFFLINE
                left = await self.announcer.leave(timeout=min(5.0, cfg.shutdown_timeout / 2))
                logger.info(
                    "announced OFFLINE" if left else "could not announce OFFLINE; the record will expire"
                )
        if self.responder is not None:
            with contextlib.suppress(Exception):
                await self.responder.stop()
        if self.transport is not None:
            with contextlib.suppress(Exception):
                await self.transport.close()
        if self.node is not None:
            await self.node.shutdown(timeout=max(1.0, cfg.shutdown_timeout / 2))
        await self.control.close()

    async def _start_node(self, remembered: tuple[KnownPeer, ...]) -> SwarmNode:
        """The swarm node, bootstrapped through the configured initial peers and the remembered ones.

        With no initial peers configured, a peer none of whose remembered peers answers starts
        on its own (as the first peer of a swarm would), so that the others, which remember it
        too, can rejoin through it; configured initial peers that do not answer are an error.
        """
        cfg = self.config
        assert self.identity is not None
        validators = make_record_validators(self.identity, cfg.swarm) + access_validators(
            cfg.swarm_secret_file, cfg.swarm, cfg.allowed_peers
        )
        peers = bootstrap_peers(cfg.initial_peers, remembered)
        if remembered:
            logger.info(
                "bootstrapping through %d configured and %d remembered peers",
                len(cfg.initial_peers),
                len(remembered),
            )
        try:
            return await SwarmNode.start(self._node_settings(peers), validators)
        except PeerUnavailable as exc:
            if cfg.initial_peers or not remembered or exc.code == ErrorCode.TIMEOUT:
                raise
            logger.warning(
                "none of the %d remembered peers answered; starting on our own, reachable for those who "
                "remember this peer (pass --initial-peers to join a running swarm)",
                len(remembered),
            )
        return await SwarmNode.start(self._node_settings([]), validators)

    def _node_settings(self, initial_peers: list[str]) -> NodeSettings:
        cfg = self.config
        return NodeSettings(
            initial_peers=initial_peers,
            host_maddrs=cfg.host_maddrs,
            announce_maddrs=cfg.announce_maddrs,
            identity_path=cfg.identity,
            startup_timeout=cfg.startup_timeout,
        )

    async def _remember(self, entries: list[PeerEntry]) -> None:
        """Add the peers in ``entries`` to the remembered ones; the file is rewritten off the event loop."""
        assert self.node is not None
        now = time.time()  # wall clock: the file outlives this run and its DHT time
        if self.known_peers.update([e.record for e in entries], self_id=self.node.peer_id, now=now):
            await asyncio.get_running_loop().run_in_executor(None, self.known_peers.save, now)

    # -- background loops -----------------------------------------------------------------------

    def _spawn(self, name: str, loop_fn: Callable[[], Awaitable[None]]) -> None:
        self._tasks[name] = asyncio.create_task(self._supervise(name, loop_fn), name=f"peerd-{name}")

    async def _supervise(self, name: str, loop_fn: Callable[[], Awaitable[None]]) -> None:
        failures = 0
        while True:
            try:
                await loop_fn()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                failures += 1
                delay = min(RESTART_BACKOFF_S[0] * 2 ** (failures - 1), RESTART_BACKOFF_S[1])
                logger.exception("%s loop failed (%d); restarting in %.0f s", name, failures, delay)
                await asyncio.sleep(delay)

    async def _cancel(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is None:
            return
        await cancel_and_wait(task)

    async def _read_loop(self) -> None:
        """Keep the local peers table fresh (status, shaping names, probe targets); reach out to the
        remembered peers it lacks."""
        interval = min(max(self.config.refresh_interval / 2, 1.0), 15.0)
        reached_out = time.monotonic()
        while True:
            if self.node is not None and not self.node.alive:
                self.failure = "the DHT process (and with it p2pd) died; this peer is cut off from the swarm"
                logger.error(self.failure)
                self.request_stop()
                return
            try:
                await self._remember(await self.refresh_peers())
                if time.monotonic() - reached_out >= max(RECONNECT_S, self.config.record_ttl):
                    reached_out = time.monotonic()
                    await self._reconnect()
            except PeerdError as exc:
                logger.warning("reading the peers table failed: %s", exc)
            await asyncio.sleep(interval)

    async def _reconnect(self) -> None:
        """Ping the remembered peers whose records this peer no longer sees, through the DHT.

        Each side of a healed partition (or a peer that was offline a while) lost the other from
        its DHT routing table, and a DHT only routes to whom it knows: without a ping across,
        the two halves would stay two swarms."""
        assert self.node is not None
        now = self.node.now()
        seen = {pid for pid, e in self.entries.items() if e.expires_at > now}
        missing = tuple(p.peer_id for p in self.known_peers.peers if p.peer_id not in seen)
        if missing and (answered := await self.node.reconnect(missing)):
            logger.info("%d of %d remembered peers out of sight answered again", answered, len(missing))

    async def refresh_peers(self) -> list[PeerEntry]:
        assert self.node is not None
        entries = await fetch_peers(self.node.dht, self.config.swarm, timeout=10.0)
        fresh = merge_peer_entries(self.entries, entries, now=self.node.now())
        new = [
            pid for pid, e in fresh.items() if pid not in self.entries and e.record.state != PeerState.OFFLINE
        ]
        self.entries = fresh
        if new and self.prober is not None:
            self._probe_wake.set()  # measure newcomers now rather than at the next round
        return sorted(fresh.values(), key=lambda e: (e.record.name, e.record.peer_id))

    def _probe_targets(self) -> list[str]:
        me = self.node.peer_id if self.node else None
        return [
            pid
            for pid, e in self.entries.items()
            if pid != me and e.record.state != PeerState.OFFLINE and self._may_probe(pid)
        ]

    def _may_probe(self, peer_id: str) -> bool:
        """A bulk probe fills a link for seconds each way, against a job's own traffic on it and the
        compute it needs: while this peer works for a job, only links never measured (newcomers) or
        last seen failing are probed; the others keep their measurement. Asked again while a round
        runs, so a job that starts mid-round stops it."""
        if self.prober is None or self.jobs is None or not self.jobs.manager.holds_work:
            return True
        return bool(self.prober.unmeasured([peer_id]))

    async def _probe_loop(self) -> None:
        assert self.prober is not None and self.announcer is not None
        while True:
            self._probe_wake.clear()
            targets = self._probe_targets()
            self.prober.forget([parse_peer_id(pid) for pid in self.entries])
            if targets:
                with self._not_upkeep():
                    results = await self.prober.refresh(
                        [parse_peer_id(pid) for pid in targets], proceed=self._may_probe
                    )
                if results:
                    self.announcer.poke()
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await within(self._probe_wake.wait(), self.config.probe_interval)

    # -- pieces ---------------------------------------------------------------------------------

    def _build_record(self, state: PeerState, seq: int, now: float) -> PeerRecord:
        assert self.node is not None
        links = list(self.prober.measurements.values()) if self.prober is not None else []
        self.idle_load.sample(time.monotonic(), working=self._working(state))
        profile = self._live_profile()
        # large swarms measure more links than one record may carry: keep the newest
        return fit_peer_record(
            PeerRecord(
                peer_id=self.node.peer_id,
                name=self.config.name,
                state=state,
                maddrs=list(self.node.maddrs),
                profile=profile,
                links=sorted(links, key=lambda m: m.peer_id),
                software_version=__version__,
                started_at=self._started_at,
                updated_at=max(now, self._started_at),
                seq=seq,
            )
        )

    def _working(self, state: PeerState | None = None) -> bool:
        """Not idle: starting up (measuring the device, joining the DHT), or planning or running a job."""
        state = self.state if state is None else state
        return state is not PeerState.ONLINE or (self.jobs is not None and self.jobs.manager.engaged)

    def _not_upkeep(self) -> contextlib.AbstractContextManager[None]:
        """Around bulk link probes, sent or answered: a daemon that works for a job mostly skips
        them, so they are not part of the idle load it declares."""
        return self.idle_load.excluding(working=self._working())

    def _live_profile(self) -> DeviceProfile | None:
        """The profile with what changes while we run read now: free memory and, on a CPU device (a
        machine's cores), the cores this daemon keeps busy without a job; the measured rates come
        from the (cached) profile."""
        if self.profile is None:
            return None
        profile = with_live_memory(self.profile, self.config.device)
        if profile.host_id is not None and self.idle_load.cores:
            profile = msgspec.structs.replace(profile, idle_cores=round(self.idle_load.cores, 4))
        return profile

    def _measure_profile(self) -> Any:
        from peerd.pipeline.messaging import measure_messaging
        from peerd.swarm.host import host_id
        from peerd.swarm.profiling import default_cache_path, profile_device

        cache = self.config.profile_cache or default_cache_path()
        profile = profile_device(self.config.device, cache_path=cache, messaging=measure_messaging)
        if self.config.machine and profile.host_id is not None:  # a CPU device on the machine it names
            profile = msgspec.structs.replace(profile, host_id=host_id(self.config.machine))
        return profile

    def _make_shaper(self) -> LinkShaper | None:
        if self.config.scenario is None:
            return None
        from peerd.sched.scenario import load_scenario

        scenario = load_scenario(self.config.scenario)

        def name_of_peer(peer: Any) -> str | None:
            entry = self.entries.get(peer.to_base58())
            return entry.record.name if entry is not None else None

        logger.info("shaping outgoing traffic as scenario %s says", self.config.scenario)
        return LinkShaper.from_scenario(scenario, self.config.name, name_of_peer)

    # -- control methods ------------------------------------------------------------------------

    async def _rpc_status(self, params: dict[str, Any]) -> dict[str, Any]:
        stale = False
        if self.node is not None:
            try:
                await self.refresh_peers()
            except PeerdError as exc:
                logger.info("status: serving the cached peers table (%s)", exc)
                stale = True
        await self._refresh_refusals()
        view = self._view()
        view["self"] = {
            "peer_id": self.node.peer_id if self.node else None,
            "name": self.config.name,
            "swarm": self.config.swarm,
            "state": self.state.value,
            "maddrs": list(self.node.maddrs) if self.node else [],
            "pid": os.getpid(),
            "home": str(self.config.home),
            "seq": self.announcer.seq if self.announcer else 0,
            "started_at": self._started_at,
            "threads": torch.get_num_threads(),
            # volunteer controls: paused (no training here until resume), leaving (handing work over)
            "paused": self.jobs is not None and self.jobs.manager.paused is not None,
            "pause_reason": self.jobs.manager.paused if self.jobs is not None else None,
            "leaving": self.leaving or (self.jobs is not None and self.jobs.manager.leaving),
            # who may join and submit: "open" (anyone who reaches a member), or members only by
            # "secret", "allowlist" or both
            "access": access_mode(self.config.swarm_secret_file, self.config.allowed_peers),
            # peers refused for a while after garbage or exceeded limits: peer id -> seconds left
            "banned": {str(p): round(s, 1) for p, s in self.transport.banlist.banned().items()}
            if self.transport is not None
            else {},
        }
        view["stale"] = stale
        return view

    def _live_entries(self, now: float) -> list[PeerEntry]:
        """The peers whose newest record has not expired at ``now``: while DHT reads fail (a dead
        bootstrap node), a crashed peer still leaves the list when its last refresh expires."""
        return [e for e in self.entries.values() if e.expires_at > now]

    def _live_records(self) -> list[PeerRecord]:
        return [e.record for e in self._live_entries(self.node.now() if self.node else 0.0)]

    def _view(self) -> dict[str, Any]:
        """Peers, links and jobs as this daemon sees them now (what status and metrics report)."""
        now = self.node.now() if self.node else 0.0
        view = peers_view(self._live_entries(now), now=now, self_id=self.node.peer_id if self.node else None)
        view["jobs"] = self.jobs.views() if self.jobs is not None else []
        view["refusals"] = self._refusals().view()
        return view

    def _admits(self, peer: Any) -> bool:
        """Whether ``peer`` may open streams here: listed (allowlist) and with a validated record (secret)."""
        peer_id = peer.to_base58()
        if self.config.allowed_peers and peer_id not in self.config.allowed_peers:
            return False
        return self.config.swarm_secret_file is None or peer_id in self.entries

    def _refusals(self) -> Refusals:
        """What this daemon refused or rejected from other peers so far (DHT records as last refreshed)."""
        t = self.transport
        return Refusals(
            streams=by_name(t.refusals) if t else {},
            handlers=by_name(t.rejections) if t else {},
            dht_records=dict(self._dht_rejected),
            job_records=dict(self.jobs.manager.rejected.codes) if self.jobs is not None else {},
            bans=t.banlist.bans_total if t else 0,
        )

    async def _refresh_refusals(self) -> None:
        """Fetch the DHT process's record rejections (its validators count them there)."""
        if self.node is None or not self.node.alive:
            return
        try:
            self._dht_rejected = await self.node.dht_rejections()
        except PeerdError as exc:
            logger.info("status: DHT record rejections as last read (%s)", exc)

    def _job_method(self, method: str) -> Callable[[dict[str, Any]], Awaitable[Any]]:
        async def call(params: dict[str, Any]) -> Any:
            if self.jobs is None:
                raise PeerUnavailable(
                    "the daemon is still starting; try again in a moment", code=ErrorCode.BUSY
                )
            return await self.jobs.handler(method)(params)

        return call

    async def _rpc_shutdown(self, params: dict[str, Any]) -> dict[str, Any]:
        logger.info("shutdown requested through the control endpoint")
        asyncio.get_running_loop().call_soon(self.request_stop)
        return {"stopping": True}

    async def _rpc_leave(self, params: dict[str, Any]) -> dict[str, Any]:
        asked = number_param(params, "grace_s", default=self.config.leave_grace_s)
        logger.info("leave requested through the control endpoint")
        grace = self.request_leave(asked)  # the reply goes out before the shutdown closes this endpoint
        return {
            "leaving": True,
            "name": self.config.name,
            "grace_s": grace,
            "shutdown_timeout_s": self.config.shutdown_timeout,
        }

    async def _rpc_partition(self, params: dict[str, Any]) -> dict[str, Any]:
        """Drop the DHT's RPCs and peerd's streams with ``peers`` for ``seconds`` (``peerd.swarm.faults``)."""
        if not fault_injection_enabled():
            raise ConfigError(
                "partition",
                f"fault injection is off: start the daemon with {FAULT_INJECTION_ENV}=1 to allow it",
            )
        peers = params.get("peers")
        if not isinstance(peers, list) or len(peers) > MAX_CUT_PEERS:
            raise ConfigError("peers", f"must be a list of at most {MAX_CUT_PEERS} peer ids")
        for peer in peers:
            try:
                parse_peer_id(peer)
            except Exception:
                raise ConfigError("peers", f"not a peer id: {str(peer)[:80]!r}") from None
        seconds = number_param(params, "seconds", default=30.0)
        if self.node is None or self.transport is None:
            raise PeerUnavailable("this daemon is still starting: no swarm node to cut off yet")
        cut = Cut(frozenset(peers), time.time() + seconds)
        await self.node.cut(tuple(sorted(cut.peers)), cut.until)
        self.transport.cut_off(cut)
        logger.warning("fault injection: cut off from %d peers for %.0f s", len(cut.peers), seconds)
        return {"cut": sorted(cut.peers), "until": cut.until}

    async def _rpc_pause(self, params: dict[str, Any]) -> dict[str, Any]:
        manager = self._manager()
        await manager.pause(text_param(params, "reason", default=""))  # "": the manager's default reason
        logger.info("paused: %s", manager.paused)
        return {"paused": True, "reason": manager.paused}

    async def _rpc_resume(self, params: dict[str, Any]) -> dict[str, Any]:
        manager = self._manager()
        was_paused = manager.paused is not None
        await manager.resume()
        logger.info("resumed" if was_paused else "resume asked while not paused")
        return {"paused": False, "was_paused": was_paused}

    def _manager(self) -> JobManager:
        if self.jobs is None:
            raise PeerUnavailable("the daemon is still starting; try again in a moment", code=ErrorCode.BUSY)
        if self.leaving:
            raise PeerdError("this peer is leaving the swarm", code=ErrorCode.BUSY)
        return self.jobs.manager


def _set_threads(threads: int | None) -> None:
    """Torch's intra-op thread count for this process, once, before any tasklet computes."""
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    logger.info("training uses %d compute threads", torch.get_num_threads())


# -- running as a process ---------------------------------------------------------------------------


@contextlib.contextmanager
def _signals_handled(
    loop: asyncio.AbstractEventLoop, on_signal: Callable[[signal.Signals], None]
) -> Iterator[None]:
    """Route SIGINT/SIGTERM to ``on_signal`` inside the loop, SIGUSR1 to a log of every task's stack
    (``kill -USR1 PID`` on a daemon that seems stuck); put the previous handlers back on exit."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    previous = {sig: signal.getsignal(sig) for sig in sigs}
    for sig in sigs[:2]:
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGUSR1, _log_stacks)
    try:
        yield
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous[sig])


def _log_stacks() -> None:
    logger.warning("SIGUSR1: the stacks of every task and thread follow\n%s", stacks())


async def serve(config: DaemonConfig, on_ready: Callable[[ReadyInfo], None] | None = None) -> None:
    """Run one daemon until SIGINT/SIGTERM or a control ``shutdown``; always shuts down cleanly."""
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    start_task = asyncio.create_task(daemon.start(), name="peerd-start")

    def on_signal(sig: signal.Signals) -> None:
        if not daemon.stop_requested:
            logger.info(
                "%s received: leaving the swarm, handing work over for at most %.0f s "
                "(send it again to skip the grace period)",
                sig.name,
                daemon.config.leave_grace_s,
            )
            daemon.request_leave()
            if not start_task.done():
                start_task.cancel()  # interrupt a slow startup; start() cleans up after itself
        else:
            logger.warning("%s received again: stopping without grace", sig.name)
            daemon.hurry()

    with _signals_handled(loop, on_signal):
        try:
            info = await start_task
        except asyncio.CancelledError:
            if not daemon.stop_requested:
                raise
            logger.info("startup interrupted")
            return
        if on_ready is not None:
            on_ready(info)
        await daemon.wait_stopped()
        await daemon.stop()
    if daemon.failure is not None:
        raise PeerdError(daemon.failure)


def run_daemon(config: DaemonConfig, on_ready: Callable[[ReadyInfo], None] | None = None) -> None:
    """Blocking entry point of ``peerd join``."""
    asyncio.run(serve(config, on_ready))


@contextlib.asynccontextmanager
async def swarm_reader(config: DaemonConfig) -> AsyncIterator[Callable[[], Awaitable[dict[str, Any]]]]:
    """A short-lived DHT client of ``config.swarm`` (no local daemon needed); yields ``read() -> status view``.

    Joins through ``config.initial_peers`` with a throw-away identity in client mode (it serves
    nothing and announces nothing); raises ``PeerUnavailable`` when no initial peer answers.
    """
    cfg = config
    if not cfg.initial_peers:
        raise ConfigError(
            "initial_peers", "reading the swarm without a local daemon needs --initial-peers MADDR"
        )
    identity = Identity.generate()
    settings = NodeSettings(
        initial_peers=cfg.initial_peers,
        host_maddrs=cfg.host_maddrs,
        startup_timeout=cfg.startup_timeout,
        client_mode=True,
    )
    validators = make_record_validators(identity, cfg.swarm) + access_validators(
        cfg.swarm_secret_file, cfg.swarm, cfg.allowed_peers
    )
    node = await SwarmNode.start(settings, validators)

    async def read() -> dict[str, Any]:
        entries = await fetch_peers(node.dht, cfg.swarm, timeout=10.0)
        view = peers_view(entries, now=node.now())
        view["self"] = None
        view["stale"] = False
        return view

    try:
        yield read
    finally:
        await node.shutdown(timeout=3.0)
