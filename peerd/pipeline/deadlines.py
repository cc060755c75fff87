"""How long a stage waits for a neighbour's message (or for it to accept ours): learnt from the steps seen.

A fixed deadline is wrong both ways: on slow links a healthy step of a big model may take
minutes (a fixed three minutes would break it), on loopback a step takes a fraction of a
second (three minutes of waiting for a dead neighbour is three minutes lost). ``StepDeadline``
starts at the configured ``initial_s`` (the first steps of an epoch include connecting and
warming up), and once it has seen ``warmup_steps`` steps it allows ``factor`` times the
slowest of the last ``window`` steps, never less than ``floor_s``:

    deadline = initial_s                                  while fewer than warmup_steps seen
    deadline = max(floor, factor * max(recent steps))     after, floor = min(floor_s, initial_s)

A step is measured from the end of the previous one, so checkpoint saves and held-out passes
between steps count: a neighbour waits through them too. The floor keeps one slow step (a
garbage collection, a busy machine) from breaking the pipeline: a broken step makes the job
re-plan, which costs far more than the wait (a deployment that set a short initial deadline
asked for short waits: the floor never exceeds it). The job-level ``StallWatch``
(``peerd.jobs.health``) applies the same idea to the published records.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from peerd.errors import ConfigError


@dataclass(frozen=True)
class DeadlineConfig:
    """How the wait for a neighbour's message follows the observed step times."""

    factor: float = 8.0
    """A wait may last this many of the slowest recent steps."""
    floor_s: float = 60.0
    """Never less than this (seconds): slow moments of a busy machine are not failures."""
    window: int = 16
    """Recent steps remembered."""
    warmup_steps: int = 2
    """Steps seen before the deadline adapts (until then: the configured initial deadline)."""

    def validate(self) -> None:
        if not self.factor >= 1:
            raise ConfigError("deadlines.factor", f"must be >= 1, got {self.factor}")
        if not self.floor_s > 0:
            raise ConfigError("deadlines.floor_s", f"must be > 0, got {self.floor_s}")
        if self.window < 1 or self.warmup_steps < 1:
            raise ConfigError("deadlines.window", "window and warmup_steps must be >= 1")


class StepDeadline:
    """The current deadline for one wait, from ``initial_s`` and the step durations ``observe``d."""

    def __init__(self, initial_s: float, config: DeadlineConfig | None = None) -> None:
        self.config = config or DeadlineConfig()
        self.config.validate()
        if not initial_s > 0:
            raise ConfigError("recv_timeout_s", f"must be > 0, got {initial_s}")
        self.initial_s = initial_s
        self._recent: deque[float] = deque(maxlen=self.config.window)
        self._seen = 0

    def observe(self, step_s: float) -> None:
        """One step took ``step_s`` seconds (negative or non-finite values are ignored)."""
        if step_s >= 0 and step_s != float("inf"):
            self._recent.append(step_s)
            self._seen += 1

    def seconds(self) -> float:
        cfg = self.config
        if self._seen < cfg.warmup_steps:
            return self.initial_s
        return max(min(cfg.floor_s, self.initial_s), cfg.factor * max(self._recent))
