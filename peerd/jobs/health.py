"""Failure detection for a running job, from public progress records only: who is gone, and should we re-plan.

Every tasklet publishes a progress record every ``heartbeat_s`` from the event loop, while
a step computes or waits too, so a slow step never silences it; only a dead (or cut-off)
daemon stops its heartbeat. A tasklet whose step broke names the partners it saw fail
(``Progress.suspects``) and turns ``recovering``. The verdict, which every peer computes
from the same records, is:

- a peer is **gone** when it left (``left``), when it is suspected by a partner and its own
  heartbeat is older than ``suspect_grace_s`` (the suspicion is confirmed by silence: a
  partner that merely saw a slow or broken stream does not remove a live peer), when its
  heartbeat is older than ``silent_grace_s`` with no suspicion at all, or when it never
  started the committed epoch's tasklet within ``start_grace_s`` of the commit; a spare (it
  publishes no record: an rl job's rollout peer) is gone when a tasklet suspects it and the
  swarm's membership no longer lists it;
- the job is **stuck** when a tasklet has been ``recovering`` while nobody is gone, for
  ``stuck_grace_s`` after its step broke (it names suspects: a transient stream failure), or
  for ``start_grace_s`` while it loads its state (no suspects): a re-plan on the same roster
  restarts the pipeline from the common step.

Either one makes every peer re-plan; the consensus makes them agree on the repair.

A pipeline can also **stall** with every heartbeat alive (a peer whose compute hangs, a
stream that stays open but carries nothing): ``StallWatch`` learns the job's typical step time
from the records and calls the job stuck when its slowest tasklet has not finished a step for
``stall_factor`` typical steps (never less than ``stall_floor_s``): adaptive, so a slow job on
slow links is not re-planned for being slow, and a fast one does not wait minutes.

A job running **short-handed** (fewer replicas than its target width: it shrank when peers
died) re-plans to grow back once newcomers are in sight (``short_handed``): peers not in the
allocation that have been online for ``grow_settle_s`` (their links are measured by then),
enough of them, with the allocation's live spares, for one more replica. A newcomer that
would not widen the job waits as a spare: it joins at the next re-plan. ``GrowthLedger``
remembers whom each growth re-plan was for, so a newcomer the consensus leaves out does not
re-plan the job forever.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from peerd.errors import ConfigError
from peerd.jobs.records import Progress, TaskState
from peerd.sched.allocation import Allocation


@dataclass(frozen=True)
class HealthConfig:
    """Detection thresholds, in seconds of DHT time."""

    heartbeat_s: float = 2.0
    """A tasklet re-publishes its progress this often, also while a step is running."""
    suspect_grace_s: float = 6.0
    """A suspected peer whose heartbeat is older than this is gone (a few missed beats plus DHT delay)."""
    silent_grace_s: float = 30.0
    """Any allocated peer whose heartbeat is older than this is gone, suspected or not."""
    start_grace_s: float = 120.0
    """After a commit, a tasklet's first heartbeat of the new epoch may take this long (state transfer)."""
    stuck_grace_s: float = 20.0
    """A tasklet whose step broke (recovering, naming suspects) this long while nobody is gone makes
    the job re-plan anyway; one still loading its state (no suspects) gets ``start_grace_s``."""

    stall_floor_s: float = 60.0
    """A job whose slowest tasklet finished no step for this long (or ``stall_factor`` typical steps,
    whichever is longer) while every heartbeat is alive is stuck."""
    stall_factor: float = 20.0
    """The stall threshold in typical step times (an EWMA of the steps the records show)."""
    grow_settle_s: float = 20.0
    """A newcomer counts towards growing a short-handed job once it has been online this long."""

    def __post_init__(self) -> None:
        if self.stall_floor_s <= 2 * self.heartbeat_s:
            raise ConfigError("health.stall_floor_s", f"must exceed 2 heartbeats ({2 * self.heartbeat_s} s)")
        if self.stall_factor < 2:
            raise ConfigError("health.stall_factor", "must be >= 2 (typical step times)")
        if self.grow_settle_s < 0:
            raise ConfigError("health.grow_settle_s", "must be >= 0")
        if self.heartbeat_s <= 0:
            raise ConfigError("health.heartbeat_s", "must be > 0")
        for name in ("suspect_grace_s", "silent_grace_s", "stuck_grace_s"):
            if getattr(self, name) <= 2 * self.heartbeat_s:
                raise ConfigError(f"health.{name}", f"must exceed 2 heartbeats ({2 * self.heartbeat_s} s)")
        if self.silent_grace_s < self.suspect_grace_s:
            raise ConfigError("health.silent_grace_s", "must be >= suspect_grace_s")


@dataclass(frozen=True)
class Verdict:
    """What the records say about one committed epoch."""

    gone: dict[str, str] = field(default_factory=dict)  # peer -> why, in words
    stuck: dict[str, str] = field(default_factory=dict)  # recovering peer -> its reason

    @property
    def replan(self) -> bool:
        return bool(self.gone or self.stuck)

    def cause(self) -> str:
        """One sentence for logs and ``peerd status``."""
        if self.gone:
            return "; ".join(f"peer {p} {why}" for p, why in sorted(self.gone.items()))
        if self.stuck:
            return "; ".join(
                f"tasklet of {p} cannot continue ({why or 'no reason given'})"
                for p, why in sorted(self.stuck.items())
            )
        return ""


def assess(
    allocation: Allocation,
    epoch: int,
    progress: Mapping[str, Progress],
    now: float,
    *,
    committed_at: float,
    recovering_since: Mapping[str, float],
    config: HealthConfig,
    online: Collection[str] | None = None,
) -> Verdict:
    """The verdict on ``allocation`` (committed in ``epoch`` at ``committed_at``) at DHT time ``now``.

    ``progress``: the job's records by peer; ``recovering_since``: when this reader first saw
    each peer's record of this epoch ``recovering`` (the reader keeps that clock itself);
    ``online``: the peers the swarm lists as online (None: not known).
    """
    current = {p: r for p, r in progress.items() if r.epoch == epoch}
    suspects: dict[str, list[str]] = {}
    for reporter, report in current.items():
        for peer in report.suspects:
            suspects.setdefault(peer, []).append(reporter)
    gone: dict[str, str] = {}
    for peer in allocation.devices:
        rec = current.get(peer)
        if rec is None:
            waited = now - committed_at
            if waited > config.start_grace_s:
                gone[peer] = f"did not start its tasklet within {waited:.0f} s of the commit"
            continue
        if rec.state == TaskState.LEFT:
            gone[peer] = "left the swarm"
            continue
        if rec.state in (TaskState.DONE, TaskState.FAILED):
            continue  # finished, or failing the job: not a reason to re-plan
        silent = now - rec.updated_at
        by = suspects.get(peer)
        if by and silent > config.suspect_grace_s:
            gone[peer] = f"stopped answering (reported by {', '.join(sorted(by))}; silent for {silent:.0f} s)"
        elif silent > config.silent_grace_s:
            gone[peer] = f"has been silent for {silent:.0f} s"
    # a spare publishes no record of its own; one that works for a tasklet (an rl job's rollout
    # peer) is gone when a tasklet names it and the swarm no longer lists it (its peer record expired)
    for peer in allocation.spares:
        by = suspects.get(peer)
        if by and online is not None and peer not in online:
            gone[peer] = f"stopped answering (reported by {', '.join(sorted(by))}) and left the swarm's list"
    stuck: dict[str, str] = {}
    if not gone:
        for peer, report in current.items():
            since = recovering_since.get(peer)
            grace = config.stuck_grace_s if report.suspects else config.start_grace_s
            if report.state == TaskState.RECOVERING and since is not None and now - since > grace:
                stuck[peer] = report.reason
    return Verdict(gone, stuck)


class StallWatch:
    """The slowest running tasklet's step over time, for one committed epoch: typical step time, stalls.

    Feed it each reading of the records (``observe``); it keeps the smallest step among the
    epoch's running tasklets, when that last advanced, and an EWMA of seconds per step.
    """

    SMOOTHING = 0.2

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.step: int | None = None
        self.since = 0.0  # when ``step`` was first seen
        self.step_time_s: float | None = None

    def observe(self, progress: Mapping[str, Progress], now: float) -> None:
        steps = [
            r.step
            for r in progress.values()
            if r.epoch == self.epoch and r.state == TaskState.RUNNING and r.step < r.steps  # not finishing
        ]
        if not steps:
            self.step = None  # recovering, done or not started: no clock runs
            return
        low = min(steps)
        if self.step is None or low < self.step:
            self.step, self.since = low, now
        elif low > self.step:
            per_step = (now - self.since) / (low - self.step)
            a = self.SMOOTHING
            self.step_time_s = (
                per_step if self.step_time_s is None else (1 - a) * self.step_time_s + a * per_step
            )
            self.step, self.since = low, now

    def threshold_s(self, config: HealthConfig) -> float:
        typical = self.step_time_s or 0.0
        return max(config.stall_floor_s, config.stall_factor * typical)

    def stalled(self, now: float, config: HealthConfig) -> str | None:
        """Why the job counts as stuck (in words), or None."""
        if self.step is None:
            return None
        waited = now - self.since
        if waited <= self.threshold_s(config):
            return None
        typical = f"{self.step_time_s:.2f} s" if self.step_time_s is not None else "unknown"
        return f"no tasklet got past step {self.step} for {waited:.0f} s (a step takes {typical})"


def following(allocation: Allocation, me: str, replanning: frozenset[str]) -> str | None:
    """Why this peer should join a re-plan others began (a cause in words), or None.

    Peers decide to re-plan on their own clocks and views, seconds apart: a spare or a
    newcomer (nothing of its own runs) follows as soon as one of the job's tasklet peers
    re-plans, so the epoch that may need it has it in its roster; a tasklet peer follows
    once half of them do (their tasklets are frozen: the pipeline has stopped anyway).
    """
    devices = set(allocation.devices)
    movers = replanning & devices
    if not movers or (me in devices and 2 * len(movers) < len(devices)):
        return None
    return f"following the re-plan of {len(movers)} of the job's {len(devices)} tasklet peers"


def settled_newcomers(
    allocation: Allocation, online_since: Mapping[str, float], now: float, *, config: HealthConfig
) -> list[str]:
    """Peers of ``online_since`` outside ``allocation`` (not even spares) online for ``grow_settle_s``."""
    members = {*allocation.devices, *allocation.spares}
    return [p for p, t in online_since.items() if p not in members and now - t >= config.grow_settle_s]


def short_handed(
    allocation: Allocation,
    target_width: int | None,
    online_since: Mapping[str, float],
    now: float,
    *,
    config: HealthConfig,
) -> str | None:
    """Why ``allocation`` should re-plan to grow (a cause in words), or None.

    ``target_width``: the replicas the job asks for (None: no stated target); ``online_since``:
    the eligible online peers (spares and newcomers alike) and when this reader first saw each.
    Only settled newcomers trigger it, so a re-plan that left them spares does not repeat.
    """
    if target_width is None or allocation.d_dp >= target_width:
        return None
    settled = settled_newcomers(allocation, online_since, now, config=config)
    spares = [p for p in allocation.spares if p in online_since]
    if not settled or len(settled) + len(spares) < allocation.d_pp:
        return None
    return (
        f"running {allocation.d_dp} of {target_width} replicas and {len(settled)} new peer(s) "
        f"(with {len(spares)} spare(s)) can add one"
    )


@dataclass
class GrowthLedger:
    """One job's newcomers that growth re-plans were made for, so none re-plans the job forever.

    A settled newcomer triggers a re-plan (``short_handed``) and is then declined: one the
    consensus leaves out (paused, or of no use to the search) must not trigger another. The
    decline settles at the next commit: a newcomer missing from its roster (its daemon still
    read the epoch before, so it applied to the next one) was not left out by the consensus and
    is asked for once more; a second miss declines it for good. A peer that goes offline and
    comes back counts as new.
    """

    declined: set[str] = field(default_factory=set)
    retried: set[str] = field(default_factory=set)
    asked: tuple[int, frozenset[str]] | None = None
    """The epoch a growth re-plan started from, and the newcomers it was for."""

    def observe(self, online: Collection[str], epoch: int, roster: Collection[str] | None) -> None:
        """Forget the peers that went offline; settle the last ask once ``epoch`` (from ``roster``) passed it."""
        self.declined &= set(online)
        self.retried &= set(online)
        if self.asked is None or roster is None or epoch <= self.asked[0]:
            return
        missed = {p for p in self.asked[1] if p not in roster and p not in self.retried}
        self.declined -= missed
        self.retried |= missed
        self.asked = None

    def ask(self, epoch: int, newcomers: Collection[str]) -> None:
        """A growth re-plan from ``epoch`` was triggered for ``newcomers``."""
        self.declined.update(newcomers)
        self.asked = (epoch, frozenset(newcomers))
