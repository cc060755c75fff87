"""A job's effective state from public records, and the progress numbers folded from its tasklets' records."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import pytest

from peerd.errors import ConfigError
from peerd.jobs.records import JobState, TaskState
from peerd.jobs.views import JOB_ID_MIN_PREFIX, JobEntry, effective_state, progress_summary, resolve_job_id
from peerd.sched.allocation import Allocation

ALLOC = Allocation.from_plain([["QmA", "QmB"], ["QmC", "QmD"]])


def entry(state: JobState = JobState.PENDING, commit: Any = None, **progress: Any) -> JobEntry:
    record = NS(state=state, epoch0_start=100.0)
    return JobEntry(record, spec=None, commit=commit, progress=progress)  # type: ignore[arg-type]


def tasklet(peer: str, state: TaskState, epoch: int = 1, **kw: Any) -> Any:
    fields = {
        "stage": 0,
        "replica": 0,
        "step": 0,
        "tokens_per_s": 0.0,
        "losses": (),
        "val_losses": (),
        "bytes": {},
        "reason": "",
        "suspects": (),
        "replicas": 0,
        "rl": None,
    }
    return NS(peer=peer, state=state, epoch=epoch, **{**fields, **kw})


def test_state_follows_the_records() -> None:
    assert effective_state(entry(), 99.0) == JobState.PENDING
    assert effective_state(entry(), 100.0) == JobState.PLANNING
    commit = NS(epoch=1, allocation=ALLOC)
    assert effective_state(entry(commit=commit), 0.0) == JobState.RUNNING
    done = {p: tasklet(p, TaskState.DONE) for p in ALLOC.devices}
    assert effective_state(entry(commit=commit, **done), 0.0) == JobState.DONE
    stale = {**done, "QmD": tasklet("QmD", TaskState.DONE, epoch=0)}  # done in an older epoch
    assert effective_state(entry(commit=commit, **stale), 0.0) == JobState.RUNNING
    failed = {**done, "QmA": tasklet("QmA", TaskState.FAILED)}
    assert effective_state(entry(commit=commit, **failed), 0.0) == JobState.FAILED
    # the owner's final word wins over what the tasklets say
    assert effective_state(entry(JobState.CANCELLED, commit, **done), 0.0) == JobState.CANCELLED


def test_progress_summary_folds_the_tasklets() -> None:
    last = {"stage": 1, "bytes": {"activations": 0, "averaging": 10, "averaging_raw": 40}}
    progress = {
        "QmA": tasklet("QmA", TaskState.RUNNING, step=5, tokens_per_s=10.0, bytes={"activations": 10}),
        "QmB": tasklet("QmB", TaskState.RUNNING, replica=1, step=4, bytes={"activations_raw": 40}),
        "QmC": tasklet("QmC", TaskState.RUNNING, step=5, losses=((3, 2.0), (4, 1.0)), **last),
        "QmD": tasklet(
            "QmD", TaskState.RUNNING, stage=1, replica=1, step=4, losses=((3, 3.0),), tokens_per_s=30.0
        ),
        "QmX": tasklet("QmX", TaskState.DONE, epoch=0, step=99),  # another epoch: ignored
    }
    out = progress_summary(progress, 1, steps=10)
    assert (out["step"], out["steps"], out["tokens_per_s"]) == (4, 10, 20.0)
    assert out["losses"] == [[3, 2.5]] and out["loss"] == 2.5  # only steps every replica completed
    assert out["bytes"] == {"activations": 10, "activations_raw": 40, "averaging": 10, "averaging_raw": 40}
    assert out["compression_ratio"] == 4.0
    assert [(t["peer"], t["stage"], t["replica"]) for t in out["tasklets"]] == [
        ("QmA", 0, 0),
        ("QmB", 0, 1),
        ("QmC", 1, 0),
        ("QmD", 1, 1),
    ]
    assert progress_summary({}, None, steps=3) == {
        "steps": 3,
        "step": 0,
        "loss": None,
        "losses": [],
        "val_loss": None,
        "val_losses": [],
        "tokens_per_s": None,
        "rl": None,
        "bytes": {},
        "tasklets": [],
    }


def test_the_held_out_curve_is_the_mean_over_the_last_stages_replicas() -> None:
    progress = {
        "QmA": tasklet("QmA", TaskState.RUNNING, step=6),
        "QmC": tasklet("QmC", TaskState.RUNNING, stage=1, step=6, val_losses=((3, 2.0), (6, 1.5))),
        "QmD": tasklet("QmD", TaskState.RUNNING, stage=1, replica=1, step=6, val_losses=((3, 3.0),)),
    }
    out = progress_summary(progress, 1, steps=10)
    assert out["val_losses"] == [[3, 2.5]] and out["val_loss"] == 2.5  # step 6: one replica only so far
    assert out["losses"] == [] and out["loss"] is None


JOBS = ["3f9a1c2e" + "0" * 24, "3f9a7d00" + "1" * 24, "77aa5500" + "2" * 24]


def test_a_job_id_or_a_unique_prefix_resolves_and_an_unknown_one_is_none():
    assert resolve_job_id(JOBS[1], JOBS) == JOBS[1]
    assert resolve_job_id("77aa", JOBS) == JOBS[2]
    assert resolve_job_id("3f9a1", JOBS) == JOBS[0]
    assert resolve_job_id("beef", JOBS) is None


@pytest.mark.parametrize(
    ("prefix", "says"),
    [("3f9", f"too short: give at least {JOB_ID_MIN_PREFIX} characters"), ("3f9a", "ambiguous: it matches")],
)
def test_a_short_or_ambiguous_prefix_says_so(prefix: str, says: str):
    with pytest.raises(ConfigError) as info:
        resolve_job_id(prefix, JOBS)
    assert info.value.field == "job_id" and says in info.value.detail
    if "ambiguous" in says:
        assert JOBS[0] in info.value.detail and JOBS[1] in info.value.detail


def test_the_loss_curve_merges_epochs_and_counts_a_step_only_with_every_replica() -> None:
    from peerd.jobs.records import Progress, TaskState
    from peerd.jobs.views import loss_curve

    def last(peer: str, epoch: int, replica: int, losses, replicas: int = 2) -> Progress:
        return Progress(
            job_id="0" * 32,
            peer=peer,
            epoch=epoch,
            stage=1,
            replica=replica,
            step=9,
            steps=10,
            state=TaskState.RUNNING,
            tokens_per_s=1.0,
            updated_at=1.0,
            started_at=0.0,
            losses=tuple(losses),
            replicas=replicas,
        )

    records = [
        last("dead", 3, 0, [(0, 4.0), (1, 3.0), (2, 2.0)]),  # died after step 2; its record stays
        # the surviving replica: the job's values before the resume step (its own were 6, 5, 4),
        # then its own; an older epoch's share must not be averaged into the job's values
        last("kept", 5, 1, [(0, 5.0), (1, 4.0), (2, 3.0), (3, 3.0), (4, 2.5)]),
        last("new", 5, 0, [(3, 1.0), (4, 0.5)]),  # the spare in the dead one's slot, from step 3
        # an overwritten record of epoch 4 shows one replica only: its steps still need both
        last("moved", 4, 0, [(5, 9.0)]),
    ]
    assert loss_curve(records, last_stage=1) == [(0, 5.0), (1, 4.0), (2, 3.0), (3, 2.0), (4, 1.5)]


def test_the_steps_before_a_growth_stay_on_the_curve() -> None:
    """1 -> 2 replicas at step 3: the newcomer lists steps 3.. only, the survivor all of them (and
    records are downsampled each on their own); steps before the growth are the survivor's, later
    ones the mean; a step one replica's record skipped is left out, one it has not completed waits."""
    from peerd.jobs.records import Progress, TaskState
    from peerd.jobs.views import loss_curve

    def last(peer: str, replica: int, step: int, losses) -> Progress:
        return Progress(
            job_id="0" * 32, peer=peer, epoch=2, stage=1, replica=replica, step=step, steps=10,
            state=TaskState.RUNNING, tokens_per_s=1.0, updated_at=1.0, started_at=0.0,
            losses=tuple(losses), replicas=2,
        )  # fmt: skip

    survivor = last(
        "kept", 0, 7, [(0, 6.0), (1, 5.0), (2, 4.0), (3, 3.0), (5, 2.0), (6, 1.0)]
    )  # 4: downsampled
    newcomer = last("new", 1, 6, [(3, 1.0), (4, 0.5), (5, 0.0)])  # joined at step 3; step 6 not done yet
    curve = loss_curve([survivor, newcomer], last_stage=1)
    assert curve == [(0, 6.0), (1, 5.0), (2, 4.0), (3, 2.0), (5, 1.0)]


def test_a_step_trained_beside_another_replica_is_never_carried_as_the_jobs_loss() -> None:
    """A re-plan after a 2-replica epoch: the daemon's curve lacks a step one replica's
    downsampled record skipped; the survivor's own loss there is one share of the mean, so its
    new record must not carry it (CI once showed one replica's 2.58 for the job's 2.80)."""
    from peerd.jobs.records import Progress, TaskState
    from peerd.jobs.runner import carried_losses
    from peerd.jobs.views import loss_curve

    def last(peer: str, epoch: int, replica: int, step: int, losses, replicas: int) -> Progress:
        return Progress(
            job_id="0" * 32, peer=peer, epoch=epoch, stage=1, replica=replica, step=step, steps=20,
            state=TaskState.RUNNING, tokens_per_s=1.0, updated_at=1.0, started_at=0.0,
            losses=tuple(losses), replicas=replicas,
        )  # fmt: skip

    alone = [(0, 9.0), (1, 8.0), (2, 7.0)]  # epoch 1: the survivor was the only replica
    beside = [(s, 1.0) for s in range(3, 9)]  # epoch 2: its share; the other replica's is 3.0
    survivor = last("kept", 2, 0, 9, alone + beside, replicas=2)
    leaver = last("gone", 2, 1, 9, [(s, 3.0) for s in (3, 4, 6, 7, 8)], replicas=2)  # 5: downsampled
    history = loss_curve([survivor, leaver], last_stage=1)
    assert history == [*alone, (3, 2.0), (4, 2.0), (6, 2.0), (7, 2.0), (8, 2.0)]

    carried = carried_losses(alone + beside, history, resume=9, shared_steps={s for s, _ in beside})
    assert carried == history
    # the daemon's memory lost the solo steps (say it restarted): the survivor's own fill them
    assert carried_losses(alone + beside, [], 9, {s for s, _ in beside}) == alone

    again = last("kept", 3, 0, 11, [*carried, (9, 0.5), (10, 0.4)], replicas=1)  # alone in epoch 3
    curve = loss_curve([again, leaver], last_stage=1)
    assert 5 not in dict(curve)  # left out, not shown as one replica's loss
    assert curve == [*history, (9, 0.5), (10, 0.4)]


def test_an_ended_jobs_records_are_read_until_every_tasklets_last_one_is_in() -> None:
    """A read right after the end may miss the final record of a tasklet (CI: another daemon's
    view of a finished rl job showed no trainer figures, for good); later reads merge newest-wins."""
    from peerd.jobs.records import JobState, Progress, TaskState
    from peerd.jobs.views import merge_final_records, records_complete

    def rec(peer: str, epoch: int, stage: int, replica: int, step: int) -> Progress:
        return Progress(
            job_id="0" * 32, peer=peer, epoch=epoch, stage=stage, replica=replica, step=step, steps=4,
            state=TaskState.DONE if step == 4 else TaskState.RUNNING, tokens_per_s=1.0,
            updated_at=float(step), started_at=0.0, replicas=2,
        )  # fmt: skip

    alloc = Allocation.from_plain([["a", "b"], ["c", "d"]])
    done = JobState.DONE
    first = {"a": rec("a", 2, 0, 0, 4), "b": rec("b", 2, 0, 1, 4), "c": rec("c", 2, 1, 0, 4)}
    assert not records_complete(first, 2, alloc, done)  # d's (stage 1, replica 1) record has not arrived
    assert not records_complete({**first, "d": rec("d", 1, 1, 1, 3)}, 2, alloc, done)  # an older epoch's
    # CI again: d's record of the epoch, but one from before its end (an rl trainer's without its curve)
    early = {**first, "d": rec("d", 2, 1, 1, 1)}
    assert not records_complete(early, 2, alloc, done)
    assert records_complete(early, 2, alloc, JobState.CANCELLED)  # a stopped job's last may be any
    later = {"a": rec("a", 2, 0, 0, 3), "d": rec("d", 2, 1, 1, 4)}  # a stale copy of a, d's last
    merged = merge_final_records(early, later)
    assert records_complete(merged, 2, alloc, done)
    assert merged["a"].step == 4 and merged["d"].step == 4  # the newer record stays
