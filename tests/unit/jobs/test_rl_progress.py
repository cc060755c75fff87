"""An rl job's figures: trainer reports -> the progress record -> the job view -> status panel, line and /metrics."""

from __future__ import annotations

import statistics
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from peerd.cli.render import console, job_line, job_panel
from peerd.errors import ProtocolError
from peerd.jobs.records import Progress, TaskState, decode_progress, encode_progress
from peerd.jobs.rl.progress import RunFigures, RunningMedian, figures, summary
from peerd.jobs.rl.report import IterationReport
from peerd.jobs.rl.runner import RLRunner
from peerd.metrics import StatusCollector

PEER = "QmS4b4CzEgSbXSUgnZKvJ99r3yBsz53Psgqi7fQT4nGrNk"


def report(i: int, **extra: Any) -> IterationReport:
    base: dict[str, Any] = dict(
        iteration=i,
        version=i + 1,
        reward_mean=0.1 * i,
        pass_rate=0.05 * i,
        format_rate=1.0,
        kl=0.01 * i,
        loss=-0.1,
        clip_fraction=0.0,
        response_len=3.0 + i,
        rollouts=64,
        updates=2,
        shards=2,
        staleness={0: 48, 1: 16},
        dropped_stale=8,
        weight_sync_bytes=1000,
        rollouts_per_s=100.0 + i,
    )
    base.update(extra)
    return IterationReport(**base)


def trainer_record(reports: list[IterationReport], epoch: int = 0, replica: int = 0) -> Progress:
    return Progress(
        job_id="ab" * 16,
        peer=PEER,
        epoch=epoch,
        stage=0,
        replica=replica,
        step=len(reports),
        steps=1000,
        state=TaskState.RUNNING,
        tokens_per_s=0.0,
        updated_at=2.0,
        started_at=1.0,
        rl=figures(reports, version=len(reports)),
    )


def test_figures_sum_the_run_and_keep_the_latest() -> None:
    reports = [report(i) for i in range(3)]
    reports[1].shards_missing = 1
    fig = figures(reports, version=3)
    assert fig.rewards == ((1, 0.0, 0.0), (2, 0.1, 0.05), (3, 0.2, 0.1))
    assert fig.staleness == ((0, 144), (1, 48))
    assert (fig.dropped_stale, fig.shards_missing, fig.weight_sync_bytes) == (24, 1, 3000)
    assert (fig.kl, fig.response_len, fig.rollouts_per_s) == (0.02, 5.0, 102.0)
    assert figures([report(0, kl=0.3), report(1, kl=0.1)], version=2).kl_max == 0.3
    assert figures([], version=0).kl_max is None
    # iterations 1 and 2 (the first waits for the run's first rollouts): 128 completions in 64/101 + 64/102 s
    assert fig.steady_rollouts_per_s == pytest.approx(128 / (64 / 101 + 64 / 102))
    assert figures(reports[:1], version=1).steady_rollouts_per_s is None


def test_a_long_run_is_downsampled_and_round_trips_the_wire() -> None:
    rec = trainer_record([report(i, pass_rate=i / 500) for i in range(500)])
    assert len(rec.rl.rewards) <= 128 and rec.rl.rewards[-1][0] == 500 and rec.rl.rewards[0][0] == 1
    assert decode_progress(encode_progress(rec)) == rec


def test_the_view_takes_the_newest_trainer_record() -> None:
    old = trainer_record([report(i) for i in range(2)], epoch=0)
    new = trainer_record([report(i) for i in range(4)], epoch=1)
    view = summary([old, new])
    assert view["version"] == 4 and view["iteration"] == 4
    assert view["kl_max"] == pytest.approx(0.03)
    assert view["reward_mean"] == pytest.approx(0.3) and view["pass_rate"] == pytest.approx(0.15)
    assert view["staleness"] == [[0, 192], [1, 64]]
    assert summary([]) is None


def test_the_counts_of_data_parallel_trainers_add_up_and_an_earlier_epochs_do_not() -> None:
    earlier = trainer_record([report(i) for i in range(2)], epoch=0)
    first = trainer_record([report(i) for i in range(3)], epoch=1)
    second = trainer_record(
        [report(i, staleness={0: 64}, dropped_stale=0) for i in range(3)], epoch=1, replica=1
    )
    view = summary([earlier, first, second])
    assert view["staleness"] == [[0, 3 * 48 + 3 * 64], [1, 3 * 16]]
    assert (view["dropped_stale"], view["weight_sync_bytes"]) == (3 * 8, 2 * 3000)
    assert view["rewards"] == summary([first])["rewards"]  # pooled by the trainers: the same on each


def test_status_line_panel_and_metrics_show_grpo(capsys) -> None:
    rl = summary([trainer_record([report(i) for i in range(4)])])
    job = {
        "job_id": "ab" * 16,
        "name": "grpo",
        "state": "running",
        "planning": {},
        "progress": {"step": 4, "steps": 10, "loss": -0.1, "tokens_per_s": None, "losses": [], "rl": rl},
    }
    job["progress"]["rl"]["pass_rate"] = 0.15  # exact, for the comparisons below
    assert job_line(job) == "running step 4/10 loss -0.1000 reward 0.300 pass 0.15 KL 0.030 103 rollouts/s"
    console().print(job_panel(job, {}))
    out = capsys.readouterr().out
    assert "KL 0.0300 (max 0.0300)" in out
    assert "pass rate 0.00 → 0.15" in out and "staleness 0:192 1:64" in out and "32 stale" in out
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: {"jobs": [job]}))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }
    jid = ("job", "ab" * 16)
    assert samples[("peerd_job_pass_rate", (jid,))] == 0.15
    assert samples[("peerd_job_policy_version", (jid,))] == 4
    assert samples[("peerd_job_kl_max", (jid,))] == pytest.approx(0.03)
    assert samples[("peerd_job_rollout_staleness", (jid, ("lag", "1")))] == 64
    assert samples[("peerd_job_rollouts_dropped_total", (jid, ("why", "stale")))] == 32
    assert samples[("peerd_job_weight_sync_bytes_total", (jid,))] == 4000


def test_a_trainer_still_warming_up_has_no_reward_yet() -> None:
    rl = summary([trainer_record([])])
    assert rl["reward_mean"] is None and rl["rewards"] == []
    job = {
        "job_id": "ab" * 16,
        "name": "grpo",
        "state": "running",
        "planning": {},
        "progress": {"step": 0, "steps": 10, "loss": None, "tokens_per_s": None, "losses": [], "rl": rl},
    }
    assert job_line(job) == "running step 0/10 loss - warming up"
    console().print(job_panel(job, {}))


def test_the_reward_curve_spans_a_trainer_hand_over() -> None:
    """The successor resumed at iteration 3: its record holds iterations 4.., the leaver's 1..3."""
    before = [report(i) for i in range(3)]
    after = [report(i, reward_mean=0.5 + i) for i in range(2, 6)]  # it redid iteration 3
    old = trainer_record(before, epoch=0)
    new = Progress(
        **{
            **{f: getattr(old, f) for f in old.__struct_fields__},
            "epoch": 1,
            "step": 6,
            "rl": figures(after, version=6),
        }
    )
    view = summary([new, old])
    assert [point[0] for point in view["rewards"]] == [1, 2, 3, 4, 5, 6]
    assert view["rewards"][2][1] == 2.5  # iteration 3 from the newer record
    assert view["reward_mean"] == 5.5 and view["iteration"] == 6
    # the leaver's iterations count towards the job's largest KL
    spiked = Progress(
        **{**{f: getattr(old, f) for f in old.__struct_fields__}, "rl": figures([report(0, kl=9.0)], 1)}
    )
    assert summary([new, spiked])["kl_max"] == 9.0


def test_phase_medians_leave_the_first_iteration_out_and_reach_the_job_view() -> None:
    reports = [
        report(0, seconds={"wait": 9.0, "train": 9.0}),  # the first waits for the first rollouts
        report(1, seconds={"wait": 0.02, "train": 0.010, "generate": 0.004}),
        report(2, seconds={"wait": 0.04, "train": 0.012}),  # shards of older peers say nothing
        report(3, seconds={"wait": 0.03, "train": 0.014, "generate": 0.006}),
    ]
    assert figures(reports[:1], version=1).phases_s is None
    record = decode_progress(encode_progress(trainer_record(reports)))
    view = summary([record])
    assert view is not None
    assert view["phases_s"] == pytest.approx({"wait": 0.03, "train": 0.012, "generate": 0.005})


def test_the_panel_shows_the_trainers_phases_with_what_lies_inside_them() -> None:
    from peerd.cli.render import RL_PHASES, rl_lines
    from peerd.jobs.rl.report import PHASES

    assert RL_PHASES == PHASES  # the panel's copy of the trainer's loop

    phases = {
        "wait": 0.0066,
        "generate": 0.0036,
        "score": 0.0004,
        "reference": 0.0023,
        "train": 0.035,
        "average": 0.026,
        "average_wait": 0.0124,
        "publish": 0.0004,
        "checkpoint": 0.0,
    }
    assert rl_lines({"phases_s": phases})[-1] == (
        "trainer's iteration, median ms: wait 6.6 (sampling 3.6), score 0.4, reference 2.3, "
        "train 35.0 (averaging 26.0, 12.4 of it waiting for the other trainers), publish 0.4, checkpoint 0.0"
    )
    assert rl_lines({"phases_s": {"wait": 0.01, "train": 0.02}})[-1].endswith("wait 10.0, train 20.0")
    assert not any("iteration" in line for line in rl_lines({"version": 1}))  # none published yet


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=60))
def test_the_running_median_is_the_median_of_every_prefix(values: list[float]) -> None:
    m = RunningMedian()
    for i, v in enumerate(values):
        m.add(v)
        assert m.value() == pytest.approx(statistics.median(values[: i + 1]))


def test_a_record_built_as_reports_come_equals_one_built_from_all_of_them() -> None:
    """The trainer's runner folds each report once (a record must not cost more as the run grows)."""
    run = RunFigures()
    reports = [
        report(
            i,
            staleness={i % 3: 64},
            seconds={"wait": 0.01 * (i % 7), "train": 0.002 * i},
            shards_missing=i % 2,
        )
        for i in range(300)
    ]
    for i, r in enumerate(reports):
        run.add(r)
        if i in (0, 1, 2, 127, 128, 299):
            assert run.figures(i + 1) == figures(reports[: i + 1], version=i + 1)
    assert run.losses == [(r.iteration, r.loss) for r in reports]
    assert run.weight_sync_bytes == 300 * 1000
    with pytest.raises(ValueError):
        RunningMedian().value()


def test_a_trainer_that_trains_iterations_again_rewinds_its_record() -> None:
    """A re-plan resumed from an older policy: the trainer trains iterations 3.. again. A record that
    repeats them would be refused by every reader's checks (the trainer fell silent); the runner
    forgets their first reports."""
    first = [report(i) for i in range(6)]
    again = [report(i, reward_mean=1.0 + i) for i in range(3, 8)]
    with pytest.raises(ProtocolError, match="rewards"):
        encode_progress(trainer_record(first + again))
    runner = SimpleNamespace(reports=list(first), run=RunFigures.of(first))
    RLRunner._rewind(runner, 3)  # type: ignore[arg-type]
    for r in again:
        runner.reports.append(r)
        runner.run.add(r)
    assert [r.iteration for r in runner.reports] == list(range(8))
    fig = runner.run.figures(8)
    assert fig == figures(first[:3] + again, version=8)
    assert [i for i, _, _ in fig.rewards] == list(range(1, 9)) and fig.rewards[3][1] == 4.0
    assert decode_progress(encode_progress(trainer_record(first[:3] + again))).rl == figures(
        first[:3] + again, 8
    )
    RLRunner._rewind(runner, 20)  # nothing to forget: the fold is kept as it is
    assert runner.run.figures(8) == fig
