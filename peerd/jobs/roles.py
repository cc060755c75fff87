"""What the job manager asks of this peer's part in one job, whatever the job's kind.

``peerd.jobs.runner.TaskletRunner`` (pretrain and finetune: a pipeline tasklet or a spare) and
``peerd.jobs.rl.runner.RLRunner`` (rl: the trainer or a rollout peer) both implement it; the
manager, the views and the service hold a ``JobRunner`` and never ask which one it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from peerd.jobs.records import Progress, TaskState
from peerd.sched.consensus.actions import Commit
from peerd.sched.consensus.messages import HeldState, RosterEntry


class JobRunner(Protocol):
    """This peer's part in one job across its commits."""

    stage: int | None
    """This peer's tasklet's stage in the current commit (None: no tasklet)."""
    replica: int | None
    state: TaskState
    step: int
    """Steps (rl: iterations) its tasklet has completed."""
    recoveries: list[dict[str, Any]]
    """Per adopted commit: where its state came from and how long resuming took."""
    unfit: str | None
    """Why this peer must not run a tasklet of this job again (None: it may)."""

    async def start(self) -> None: ...

    async def adopt(
        self, commit: Commit, roster: list[RosterEntry] | None, history: Sequence[tuple[int, float]] = ()
    ) -> None:
        """Take this peer's part in ``commit`` (``history``: the job's loss curve this daemon remembers)."""

    async def freeze(self, reason: str) -> None:
        """Stop computing and keep the state for the re-plan that follows."""

    def held(self) -> tuple[HeldState, ...]:
        """The state this peer can serve to the re-plan's allocation."""

    async def leave(self, reason: str) -> None:
        """Hand the part over (publish ``left``), still serving the state."""

    async def retire(self) -> None:
        """The job ended: stop, publish the final record."""

    async def close(self) -> None:
        """Release everything (the daemon stops or the job is gone)."""

    def provide(self, stage: int, step: int) -> bytes | None:
        """A checkpoint's bytes for ``peerd fetch`` when this peer holds it."""

    def progress(self) -> Progress | None:
        """The record this peer's tasklet publishes now (None: it runs none)."""

    def phases(self) -> dict[str, float]:
        """Mean seconds per step in each phase of its tasklet's steps (empty: none measured)."""

    def s_per_step(self) -> float | None:
        """Mean wall seconds from one of its tasklet's steps' end to the next one's (None: not measured)."""
