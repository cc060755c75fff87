"""Failure detection from progress records: a slow tasklet is not gone, a silent suspected one is."""

from __future__ import annotations

import pytest

from peerd.errors import ConfigError
from peerd.jobs.health import GrowthLedger, HealthConfig, StallWatch, assess, following, short_handed
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


def test_a_suspected_spare_is_gone_once_the_swarm_no_longer_lists_it() -> None:
    """An rl job's rollout peers are spares: they publish no record, the trainer names the absent one."""
    rl = Allocation.from_plain([["a"]], ["r1", "r2"])
    progress = {"a": rec("a", 99.0, suspects=("r2",))}

    def judge(online):
        return assess(
            rl, 3, progress, 100.0, committed_at=50.0, recovering_since={}, config=CFG, online=online
        )

    assert not judge({"a", "r1", "r2"}).replan  # suspected, still listed: a slow shard, not a death
    assert not judge(None).replan  # membership unknown: no verdict on spares
    v = judge({"a", "r1"})
    assert list(v.gone) == ["r2"] and "reported by a" in v.gone["r2"]
    progress["a"] = rec("a", 99.0)  # not suspected: an unlisted spare is no reason to re-plan
    assert not judge({"a"}).replan


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


# -- growing back onto newcomers --------------------------------------------------------------

SHRUNK = Allocation.from_plain([["a"], ["c"]], spares=["s"])  # was 2 x 2: it lost b and d


def test_a_short_handed_job_grows_once_enough_newcomers_have_settled():
    online = {"a": 0.0, "c": 0.0, "s": 0.0, "n": 70.0}
    cause = short_handed(SHRUNK, 2, online, 100.0, config=CFG)
    assert cause is not None and "1 of 2 replicas" in cause and "1 new peer(s)" in cause  # n + spare s


def test_no_growth_without_a_settled_newcomer_or_without_room_for_a_replica():
    assert (
        short_handed(SHRUNK, 2, {"a": 0.0, "c": 0.0, "s": 0.0, "n": 90.0}, 100.0, config=CFG) is None
    )  # 10 s
    assert (
        short_handed(SHRUNK, 2, {"a": 0.0, "c": 0.0, "n": 0.0}, 100.0, config=CFG) is None
    )  # s gone: 1 < d_pp
    assert (
        short_handed(SHRUNK, 2, {"a": 0.0, "c": 0.0, "s": 0.0}, 100.0, config=CFG) is None
    )  # only the spare
    full = Allocation.from_plain([["a", "b"], ["c", "d"]])
    assert short_handed(full, 2, {"n": 0.0, "m": 0.0}, 100.0, config=CFG) is None  # at its width
    assert short_handed(SHRUNK, None, {"n": 0.0, "m": 0.0}, 100.0, config=CFG) is None  # no stated target


# -- stalls, measured in the job's own step times -----------------------------------------------


def feed(watch: StallWatch, t: float, steps: dict[str, int], state: TaskState = TaskState.RUNNING) -> None:
    watch.observe({p: rec(p, t, state=state, step=s) for p, s in steps.items()}, t)


def test_the_stall_threshold_follows_the_observed_step_time():
    cfg = HealthConfig(stall_floor_s=10.0, stall_factor=5.0)
    watch = StallWatch(epoch=3)
    for k in range(6):  # the slowest tasklet finishes a step every 4 s
        feed(watch, 4.0 * k, {"a": k + 1, "b": k, "c": k, "d": k + 2})
    assert watch.step == 5 and watch.step_time_s == pytest.approx(4.0)
    assert watch.threshold_s(cfg) == pytest.approx(20.0)  # 5 typical steps, above the floor
    feed(watch, 39.0, {"a": 6, "b": 5, "c": 5, "d": 7})
    assert watch.stalled(39.0, cfg) is None  # 19 s without a step: slow, not stalled
    feed(watch, 41.0, {"a": 6, "b": 5, "c": 5, "d": 7})
    why = watch.stalled(41.0, cfg)
    assert why is not None and "step 5 for 21 s" in why and "4.00 s" in why


def test_a_fast_job_has_the_floor_and_a_job_not_running_has_no_clock():
    cfg = HealthConfig(stall_floor_s=10.0, stall_factor=5.0)
    watch = StallWatch(epoch=3)
    for k in range(10):
        feed(watch, 0.1 * k, {"a": k, "c": k})
    assert watch.threshold_s(cfg) == 10.0
    feed(watch, 30.0, {"a": 9, "c": 9}, state=TaskState.RECOVERING)  # a re-plan's wait is not a stall
    assert watch.stalled(30.0, cfg) is None
    feed(watch, 31.0, {"a": 9, "c": 9})
    assert watch.stalled(40.0, cfg) is None and watch.stalled(41.5, cfg) is not None  # counted from 31 s
    feed(watch, 50.0, {"a": 10, "c": 10})  # steps: 10, all done but not yet marked: finishing, not stalled
    assert watch.step is None and watch.stalled(200.0, cfg) is None
    other = StallWatch(epoch=4)  # another epoch's records do not count
    feed(other, 0.0, {"a": 1})
    assert other.step is None


def test_spares_follow_one_tasklet_peer_into_a_replan_and_tasklet_peers_follow_half():
    assert following(ALLOC, "s", frozenset({"a"})) is not None  # a spare (or newcomer): one is enough
    assert following(ALLOC, "s", frozenset({"x"})) is None  # not one of the job's tasklet peers
    assert following(ALLOC, "b", frozenset({"a"})) is None  # 1 of 4: b's own checks decide
    why = following(ALLOC, "b", frozenset({"a", "c"}))
    assert why is not None and "2 of the job's 4" in why
    assert following(ALLOC, "b", frozenset()) is None


def test_the_growth_ledger_declines_a_newcomer_the_consensus_left_out():
    ledger = GrowthLedger()
    ledger.ask(1, ["n"])
    assert ledger.declined == {"n"}
    ledger.observe({"a", "n"}, 1, {"a"})  # the re-plan has not committed yet
    assert ledger.declined == {"n"} and ledger.asked == (1, frozenset({"n"}))
    ledger.observe({"a", "n"}, 2, {"a", "n"})  # it applied, and was left out: stays declined
    assert ledger.declined == {"n"} and ledger.asked is None


def test_the_growth_ledger_asks_once_more_for_a_newcomer_that_missed_the_roster():
    ledger = GrowthLedger()
    ledger.ask(1, ["n"])
    ledger.observe({"a", "n"}, 2, {"a"})  # its entry missed the roster: one more try
    assert "n" not in ledger.declined
    ledger.ask(2, ["n"])
    ledger.observe({"a", "n"}, 3, {"a"})  # missed twice: declined for good
    assert ledger.declined == {"n"}


def test_the_growth_ledger_forgets_a_peer_that_went_offline():
    ledger = GrowthLedger()
    ledger.ask(1, ["n"])
    ledger.observe({"a", "n"}, 2, {"a"})
    ledger.ask(2, ["n"])
    ledger.observe({"a"}, 2, None)  # offline: a return counts as new, with its retry again
    assert not ledger.declined and not ledger.retried
    ledger.ask(2, ["n"])
    ledger.observe({"a", "n"}, 3, {"a"})
    assert "n" not in ledger.declined
