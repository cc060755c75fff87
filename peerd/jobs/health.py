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
  started the committed epoch's tasklet within ``start_grace_s`` of the commit;
- the job is **stuck** when a tasklet has been ``recovering`` while nobody is gone, for
  ``stuck_grace_s`` after its step broke (it names suspects: a transient stream failure), or
  for ``start_grace_s`` while it loads its state (no suspects): a re-plan on the same roster
  restarts the pipeline from the common step.

Either one makes every peer re-plan; the consensus makes them agree on the repair.
"""

from __future__ import annotations

from collections.abc import Mapping
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

    def __post_init__(self) -> None:
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
) -> Verdict:
    """The verdict on ``allocation`` (committed in ``epoch`` at ``committed_at``) at DHT time ``now``.

    ``progress``: the job's records by peer; ``recovering_since``: when this reader first saw
    each peer's record of this epoch ``recovering`` (the reader keeps that clock itself).
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
    stuck: dict[str, str] = {}
    if not gone:
        for peer, report in current.items():
            since = recovering_since.get(peer)
            grace = config.stuck_grace_s if report.suspects else config.start_grace_s
            if report.state == TaskState.RECOVERING and since is not None and now - since > grace:
                stuck[peer] = report.reason
    return Verdict(gone, stuck)
