"""StepDeadline: the wait for a neighbour follows the observed step times."""

from __future__ import annotations

import pytest

from peerd.errors import ConfigError
from peerd.pipeline.deadlines import DeadlineConfig, StepDeadline


def test_the_initial_deadline_holds_until_enough_steps_are_seen() -> None:
    deadline = StepDeadline(180.0, DeadlineConfig(warmup_steps=2, floor_s=60.0, factor=8.0))
    assert deadline.seconds() == 180.0
    deadline.observe(0.5)
    assert deadline.seconds() == 180.0
    deadline.observe(0.4)
    assert deadline.seconds() == 60.0  # fast steps: the floor, not three minutes


def test_slow_steps_stretch_the_deadline_past_the_initial_one() -> None:
    """On slow links a healthy step may take minutes: a fixed deadline would break it."""
    deadline = StepDeadline(180.0, DeadlineConfig(warmup_steps=2, floor_s=60.0, factor=8.0))
    for seconds in (40.0, 45.0, 50.0):
        deadline.observe(seconds)
    assert deadline.seconds() == 8.0 * 50.0


def test_the_slowest_step_of_the_window_counts_and_old_ones_are_forgotten() -> None:
    deadline = StepDeadline(180.0, DeadlineConfig(warmup_steps=1, floor_s=1.0, factor=4.0, window=3))
    deadline.observe(10.0)
    deadline.observe(1.0)
    assert deadline.seconds() == 40.0
    deadline.observe(1.0)
    deadline.observe(2.0)  # the 10 s step left the window
    assert deadline.seconds() == 8.0


def test_a_short_initial_deadline_caps_the_floor() -> None:
    deadline = StepDeadline(10.0, DeadlineConfig(warmup_steps=1, floor_s=60.0, factor=8.0))
    deadline.observe(0.1)
    assert deadline.seconds() == 10.0


def test_nonsense_durations_are_ignored() -> None:
    deadline = StepDeadline(30.0, DeadlineConfig(warmup_steps=1, floor_s=1.0, factor=2.0))
    deadline.observe(-1.0)
    deadline.observe(float("inf"))
    deadline.observe(float("nan"))
    assert deadline.seconds() == 30.0


@pytest.mark.parametrize(
    "config", [DeadlineConfig(factor=0.5), DeadlineConfig(floor_s=0), DeadlineConfig(window=0)]
)
def test_bad_settings_are_refused(config: DeadlineConfig) -> None:
    with pytest.raises(ConfigError):
        StepDeadline(10.0, config)
