"""``peerd bench wan``'s report: the commit scored again on the roster a daemon's status shows; the tasklets' phases."""

from __future__ import annotations

import pytest

from peerd.bench.wan import arm_spec, arms, measured_parts, phase_summary, prediction_parts, ratios
from peerd.jobs.scoring import RosterScorer
from peerd.jobs.spec import parse_job_spec
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import Roster, RosterDevice, RosterEntry, RosterLink

PEERS = ["QmA", "QmB", "QmC", "QmD"]


def _status() -> dict:
    rows = [
        {
            "peer_id": p,
            "tflops": {"fp32": 0.05 * (i + 1)},
            "memory_free_bytes": 4 << 30,
            "memory_total_bytes": 8 << 30,
        }
        for i, p in enumerate(PEERS)
    ]
    links = [
        {"src": a, "dst": b, "status": "ok", "rtt_ms": 2.0 + i, "bw_up_mbps": 50.0 + 5 * i}
        for i, (a, b) in enumerate((a, b) for a in PEERS for b in PEERS if a != b)
    ]
    return {"peers": rows, "links": links}


def test_the_commit_is_scored_again_with_its_parts_and_its_roster() -> None:
    spec = arm_spec(arms(1)[0], 4, 6)  # 2 stages x 2 replicas, compressed
    alloc = {"epoch": 2, "roster": PEERS, "stages": [["QmA", "QmC"], ["QmB", "QmD"]], "spares": []}
    status = _status()
    got = prediction_parts(spec, alloc, status)
    assert got is not None and "error" not in got

    # the daemons' own entries, as peerd.jobs.service writes them, scored by the job's cost model
    def entry(i: int, peer: str) -> RosterEntry:
        links = tuple(
            RosterLink(x["dst"], x["rtt_ms"] / 2e3, x["bw_up_mbps"] * 1e6)
            for x in status["links"]
            if x["src"] == peer
        )
        return RosterEntry("j", 2, peer, 0.0, RosterDevice(0.05 * (i + 1), 4 << 30, ""), links)

    direct = Roster.of(2, [entry(i, p) for i, p in enumerate(PEERS)])
    expected = RosterScorer(parse_job_spec(spec)).cost(direct, Allocation((("QmA", "QmC"), ("QmB", "QmD"))))
    assert got["s_per_step"] == pytest.approx(expected.total) and got["s_per_step"] > 0
    assert got["parts"] == pytest.approx(expected.parts)
    parts = got["parts"]
    assert parts["pp"] + parts["dp"] + parts["norm"] == pytest.approx(got["s_per_step"])
    # the job clips its gradients: the norm's trip over the one boundary and back, at its slower pair
    delay = {(x["src"], x["dst"]): x["rtt_ms"] / 2e3 for x in status["links"]}
    hop = max(
        (delay["QmA", "QmB"] + delay["QmB", "QmA"]) / 2, (delay["QmC", "QmD"] + delay["QmD", "QmC"]) / 2
    )
    assert parts["norm"] == pytest.approx(2 * hop)
    assert [e["peer"] for e in got["roster"]] == PEERS and len(got["roster"][0]["links"]) == 3


def test_a_status_without_a_members_row_says_so() -> None:
    spec = arm_spec(arms(1)[0], 4, 6)
    alloc = {"epoch": 2, "roster": [*PEERS, "QmGone"], "stages": [["QmA", "QmC"], ["QmB", "QmD"]]}
    got = prediction_parts(spec, alloc, _status())
    assert got is not None and "QmGone" in got["error"]
    assert prediction_parts(spec, alloc, {}) is None


def test_phases_are_summed_up_and_kept_per_tasklet_in_pipeline_order() -> None:
    tasklets = [
        {"stage": 1, "replica": 0, "phases_s": {"compute": 0.3, "wait": 0.1}},
        {"stage": 0, "replica": 1, "phases_s": {"compute": 0.1, "averaging": 0.5}},
        {"stage": 0, "replica": 0, "phases_s": {"compute": 0.2}},
    ]
    got = phase_summary(tasklets)
    assert got["tasklets"] == 3 and got["dominant"] == "compute"
    assert got["mean_s_per_step"] == pytest.approx({"averaging": 0.5 / 3, "compute": 0.2, "wait": 0.1 / 3})
    assert got["max_s_per_step"] == {"averaging": 0.5, "compute": 0.3, "wait": 0.1}
    assert [(t["stage"], t["replica"]) for t in got["by_tasklet"]] == [(0, 0), (0, 1), (1, 0)]
    assert phase_summary([]) == {}


def test_the_measured_step_is_split_like_the_prediction() -> None:
    def tasklet(compute: float, wait: float, send: float, norm: float, update: float) -> dict:
        phases = {
            "compute": compute,
            "wait": wait,
            "send": send,
            "averaging": 0.1,
            "norm": norm,
            "update": update,
        }
        return {"stage": 0, "replica": 0, "phases_s": phases}

    # the second tasklet ends the pipeline last (0.35 s) and waits least for the norm (0.02 s)
    got = measured_parts([tasklet(0.1, 0.1, 0.05, 0.2, 0.01), tasklet(0.1, 0.2, 0.05, 0.02, 0.03)], 0.7)
    assert got == pytest.approx({"pp": 0.35, "norm": 0.02, "update": 0.03, "dp": 0.3})
    assert measured_parts([], 0.7) is None and measured_parts([tasklet(0.1, 0, 0, 0, 0)], None) is None


def test_every_arm_holds_out_the_same_windows_and_the_ratios_compare_their_held_out_loss() -> None:
    for arm in arms(1):
        job = parse_job_spec(arm_spec(arm, 8, 20))
        assert job.data.validation is not None and job.data.validation.interval == 20  # after the last step
    results = [
        {"arm": "a-peerd", "tokens_per_s": 200.0, "final_val_loss": 3.06, "loss_vs_tokens": [[1024, 3.5]]},
        {
            "arm": "b-peerd-fp32",
            "tokens_per_s": 100.0,
            "final_val_loss": 3.0,
            "loss_vs_tokens": [[1024, 3.4]],
        },
        *(
            {
                "arm": f"c-random-s{k}",
                "tokens_per_s": 50.0,
                "final_val_loss": v,
                "loss_vs_tokens": [[1024, 3.4]],
            }
            for k, v in enumerate((2.9, 3.0, 3.2))
        ),
        {"arm": "d-dp-only", "tokens_per_s": 150.0, "final_val_loss": None},
    ]
    got = ratios(results)
    assert got["a_val_loss_over_c_val_loss"] == pytest.approx(3.06 / 3.0)  # over the median seed
    assert set(got["val_loss"]) == {"a-peerd", "b-peerd-fp32", "c-random-s0", "c-random-s1", "c-random-s2"}
    assert got["a_over_c_tokens_per_s"] == pytest.approx(4.0)
