"""Failure detection from progress records: a slow tasklet is not gone, a silent suspected one is."""

from __future__ import annotations

import pytest

from peerd.errors import ConfigError
from peerd.jobs.health import HealthConfig, assess
from peerd.jobs.records import Progress, TaskState
from peerd.sched.allocation import Allocation

ALLOC = Allocation.from_plain([["a", "b"], ["c", "d"]])
CFG = HealthConfig(
    heartbeat_s=2.0, suspect_grace_s=8.0, silent_grace_s=30.0, start_grace_s=60.0, stuck_grace_s=20.0
)


def rec(peer: str, updated: float, state: TaskState = TaskState.RUNNING, epoch: int = 3, suspects=(), step=5):
    stage, replica = {"a": (0, 0), "b": (0, 1), "c": (1, 0), "d": (1, 1)}[peer]
    return Progress(
        job_id="0" * 32,
        peer=peer,
        epoch=epoch,
        stage=stage,
        replica=replica,
        step=step,
        steps=10,
        state=state,
        tokens_per_s=1.0,
        updated_at=updated,
        started_at=0.0,
        suspects=tuple(suspects),
        reason="stream to c broke" if state == TaskState.RECOVERING else "",
    )


def verdict(progress, now=100.0, since=None):
    return assess(ALLOC, 3, progress, now, committed_at=50.0, recovering_since=since or {}, config=CFG)


def test_all_heartbeats_fresh_no_replan() -> None:
    v = verdict({p: rec(p, 99.0) for p in "abcd"})
    assert not v.replan and v.cause() == ""


def test_a_slow_step_is_not_a_death_while_the_heartbeat_beats() -> None:
    # d's step has not advanced for a minute, but it keeps publishing: not gone, even if suspected
    progress = {p: rec(p, 99.0) for p in "abc"} | {"d": rec("d", 97.0, step=1)}
    progress["b"] = rec("b", 99.0, TaskState.RECOVERING, suspects=("d",))
    assert not verdict(progress).gone


def test_a_suspected_peer_silent_past_the_grace_is_gone() -> None:
    progress = {p: rec(p, 99.0) for p in "abc"} | {"d": rec("d", 90.0)}
    progress["b"] = rec("b", 99.0, TaskState.RECOVERING, suspects=("d",))
    v = verdict(progress)
    assert list(v.gone) == ["d"] and "reported by b" in v.gone["d"] and v.replan
    assert "peer d stopped answering" in v.cause()


def test_silence_without_suspicion_needs_the_longer_grace() -> None:
    progress = {p: rec(p, 99.0) for p in "abc"} | {"d": rec("d", 90.0)}
    assert not verdict(progress).gone
    assert list(verdict(progress, now=121.0).gone) == ["d"]


def test_a_peer_that_never_started_this_epoch_is_gone_after_the_start_grace() -> None:
    progress = {p: rec(p, 99.0) for p in "abc"} | {"d": rec("d", 99.0, epoch=2)}
    assert not verdict(progress).gone
    assert "did not start" in verdict(progress, now=111.0).gone["d"]


def test_left_is_gone_at_once_and_done_or_failed_never() -> None:
    progress = {p: rec(p, 10.0, TaskState.DONE) for p in "ab"}
    progress |= {"c": rec("c", 10.0, TaskState.FAILED), "d": rec("d", 99.0, TaskState.LEFT)}
    assert verdict(progress).gone == {"d": "left the swarm"}


def test_loading_state_gets_the_start_grace_before_it_counts_as_stuck() -> None:
    progress = {p: rec(p, 99.0) for p in "abd"} | {"c": rec("c", 99.0, TaskState.RECOVERING)}
    assert not verdict(progress, since={"c": 70.0}).replan  # 30 s loading: fine
    assert verdict(progress, since={"c": 30.0}).stuck  # 70 s > start_grace 60 s


def test_recovering_with_nobody_gone_is_stuck_after_its_grace() -> None:
    broke = rec("c", 99.0, TaskState.RECOVERING, suspects=("d",))
    progress = {p: rec(p, 99.0) for p in "abd"} | {"c": broke}
    assert not verdict(progress, since={"c": 90.0}).replan
    v = verdict(progress, since={"c": 70.0})
    assert v.stuck == {"c": "stream to c broke"} and "cannot continue" in v.cause()


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"heartbeat_s": 0}, "health.heartbeat_s"),
        ({"suspect_grace_s": 3.0}, "health.suspect_grace_s"),
        ({"silent_grace_s": 5.0}, "health.silent_grace_s"),
    ],
)
def test_thresholds_are_checked(kw: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        HealthConfig(**kw)
    assert err.value.field == field
