"""``peerd bench rl-swarm``'s pure parts: the job it submits, the target arithmetic, the rates, the roster it rebuilds."""

from __future__ import annotations

import pytest

from peerd.bench.rl_swarm import Settings, job_spec
from peerd.bench.rl_swarm_report import (
    async_ratio,
    comparison,
    curve_points,
    gradient_report,
    heldout_summary,
    kill_report,
    predict,
    prediction_report,
    relative_error,
    swarm_tasks,
    target,
    throughput,
)
from peerd.bench.rosters import committed_roster, probed_links
from peerd.jobs.scoring_rl import RLRosterScorer
from peerd.jobs.spec import parse_job_spec
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import Roster, RosterDevice, RosterEntry, RosterLink
from peerd.wire.types import ElementCosts


def test_the_job_is_a_valid_rl_job_of_the_settings() -> None:
    s = Settings(peers=4, prompts=16, group_size=8, iterations=50, d_model=32)
    spec = job_spec(s, staleness=2, iterations=7, name="x")
    job = parse_job_spec(spec)
    assert job.kind == "rl" and job.steps == 7 and job.global_batch == 128 and job.micro_batch == 64
    assert job.min_peers == job.max_peers == 4 and job.model.gpt_config().d_model == 32
    rl = job.rl_settings()
    assert rl.staleness == 2 and rl.group_size == 8
    assert rl.sampling.max_new_tokens == 3  # 1-digit addition: up to 2 answer digits and the end marker
    assert job_spec(Settings(prompts=3), staleness=0, iterations=2, name="y")["micro_batch"] == 24


def test_target_is_three_times_the_start_capped_at_0_6() -> None:
    assert target(0.1) == pytest.approx(0.3) and target(0.25) == 0.6 and target(0.0) == 0.0
    start = {"pass_rate": 0.1, "reward_mean": 0.5}
    met = heldout_summary(start, {"pass_rate": 0.31, "reward_mean": 0.9}, [0.01, 0.2, 0.05])
    assert met["target_met"] and met["kl_max"] == 0.2 and met["pass_rate_ratio"] == pytest.approx(3.1)
    assert not heldout_summary(start, {"pass_rate": 0.29, "reward_mean": 0.9}, [])["target_met"]
    # a start at 0 has a target of 0: only a rise counts
    zero = {"pass_rate": 0.0, "reward_mean": 0.0}
    assert not heldout_summary(zero, zero, [])["target_met"]
    assert heldout_summary(zero, {"pass_rate": 0.01, "reward_mean": 0.1}, [])["pass_rate_ratio"] is None


def test_rates_errors_and_curve() -> None:
    assert throughput([(1.0, 1), (3.0, 3), (5.0, 5)], 32) == pytest.approx(4 * 32 / 4)
    assert throughput([(1.0, 1)], 32) is None and throughput([(1.0, 2), (1.0, 3)], 8) is None
    assert relative_error(1.3, 1.0) == pytest.approx(0.3) and relative_error(1.0, 0.0) is None
    polled = {
        1: {"kl": 0.0, "pass_rate": 0.1, "reward_mean": 0.2},  # before a re-plan: not in the newest record
        3: {"kl": 0.01, "response_len": 2.5, "pass_rate": 0.4, "reward_mean": 0.6},
    }
    points = curve_points([[2, 0.5, 0.25], [3, 0.75, 0.5]], polled)
    assert points == [
        {"iteration": 1, "kl": 0.0, "pass_rate": 0.1, "reward_mean": 0.2, "from": "poll"},
        {"iteration": 2, "reward_mean": 0.5, "pass_rate": 0.25},
        {"iteration": 3, "reward_mean": 0.75, "pass_rate": 0.5, "kl": 0.01, "response_len": 2.5},
    ]
    fast, slow = {"rollouts_per_s": 300.0, "rollouts_per_s_daemon_median": 500.0}, {"rollouts_per_s": 100.0}
    assert async_ratio(slow, fast)["async_over_sync_rollouts_per_s"] == pytest.approx(3.0)
    # too short for two polls: the trainers' own rates
    got = async_ratio({"rollouts_per_s": None, "rollouts_per_s_daemon_median": 250.0}, fast)
    assert got["async_over_sync_rollouts_per_s"] == pytest.approx(2.0) and "median" in got["ratio_source"]
    assert async_ratio(None, fast)["async_over_sync_rollouts_per_s"] is None
    # the trainers' own clocks come first: the polls' ends move with the DHT's delay
    clocked = async_ratio({**slow, "rollouts_per_s_trainer": 80.0}, {**fast, "rollouts_per_s_trainer": 120.0})
    assert clocked["async_over_sync_rollouts_per_s"] == pytest.approx(1.5)
    assert clocked["ratio_source"].startswith("the trainer's own clock")
    table = comparison({"generate": 2.0, "sync": 1.0}, {"generate": 1.6})
    assert set(table) == {"generate"} and table["generate"]["relative_error"] == pytest.approx(0.25)


def _status() -> dict:
    peers = ["QmA", "QmB", "QmC"]
    rows = [
        {
            "peer_id": p,
            "name": f"peer{i}",
            "tflops": {"fp32": 0.05 * (i + 1)},
            "memory_free_bytes": 4 << 30,
            "memory_total_bytes": 8 << 30,
            "host_id": "00ff00ff00ff00ff",
            "host_cores": 2,
            "threads": 1,
        }
        for i, p in enumerate(peers)
    ]
    links = [
        {"src": a, "dst": b, "status": "ok", "rtt_ms": 0.4 + i, "bw_up_mbps": 900.0 + 10 * i}
        for i, (a, b) in enumerate((a, b) for a in peers for b in peers if a != b)
    ]
    links.append(
        {"src": "QmA", "dst": "QmZ", "status": "ok", "rtt_ms": 1.0, "bw_up_mbps": 5.0}
    )  # not a member
    links.append({"src": "QmB", "dst": "QmA", "status": "failed", "rtt_ms": None, "bw_up_mbps": None})
    return {"peers": rows, "links": links}


def test_the_rebuilt_roster_scores_like_the_daemons_entries() -> None:
    status = _status()
    alloc = {"epoch": 3, "roster": ["QmA", "QmB", "QmC"], "stages": [["QmB"]], "spares": ["QmA", "QmC"]}
    costs = ElementCosts(gelu=1e-9, softmax=2e-10, attention=6e-7, attention_backward=9e-7)
    measured = RosterDevice(0.0, 0, "", 12e9, 4e-6, element_s=costs)
    roster = committed_roster(status, alloc, measured)
    assert roster.peers == ("QmA", "QmB", "QmC")
    a = roster.entry("QmA")
    assert a is not None and [link.peer for link in a.links] == ["QmB", "QmC"]
    assert a.links[0].delay_s == pytest.approx(0.2e-3) and a.links[0].bandwidth_bps == pytest.approx(900e6)

    # what the daemons' own entries (peerd.jobs.service) would say, scored by the job's cost model
    def entry(i: int, peer: str) -> RosterEntry:
        mine = [x for x in status["links"] if x["src"] == peer and x["dst"] in alloc["roster"]]
        links = tuple(
            RosterLink(x["dst"], x["rtt_ms"] / 2e3, x["bw_up_mbps"] * 1e6)
            for x in mine
            if x["status"] == "ok"
        )
        device = RosterDevice(0.05 * (i + 1), 4 << 30, "", 12e9, 4e-6, "00ff00ff00ff00ff", 2, 1, costs)
        return RosterEntry("j", 3, peer, 0.0, device, links)

    direct = Roster.of(3, [entry(i, p) for i, p in enumerate(alloc["roster"])])
    spec = parse_job_spec(job_spec(Settings(peers=3), staleness=0, iterations=5, name="r"))
    expected = RLRosterScorer(spec).predict(direct, Allocation((("QmB",),), ("QmA", "QmC")))
    got = predict(spec, roster, alloc)
    terms = got.pop("terms_s")
    assert got == expected.to_dict() and got["seconds"] > 0
    assert set(got["tasks"]) == {"generate", "reference", "actor_train"}
    # each task's seconds split into its arithmetic and links, its ops' launches and their traffic
    for task, seconds in got["tasks"].items():
        parts = {k: v for k, v in terms[task].items() if k != "bound"}
        assert sum(parts.values()) == pytest.approx(seconds) and min(parts.values()) >= 0
        assert parts["launches"] > 0 and parts["traffic"] > 0 and terms[task]["bound"] in parts
    # width 32 at 4 µs per op: generation is its ops (three tokens, ~600 of them), not its FLOPs
    assert terms["generate"]["bound"] == "launches"
    # the links among the members as probed (the failed one and the non-member left out)
    links = probed_links(status, alloc)
    assert links["measured"] == 6
    assert links["rtt_ms"] == pytest.approx({"min": 0.4, "median": 2.9, "max": 5.4})
    assert links["bw_up_mbps"]["max"] == 950.0

    report = prediction_report(
        got,
        {
            "iterations": 3,
            "rollout_shards": 2,
            "median_s": {"generate": 0.1, "reference": 0.01, "actor_train": 0.2},
        },
        iteration_s=2 * got["seconds"],
        committed=got["seconds"],
    )
    assert report["rebuilt_over_committed"] == pytest.approx(1.0)
    assert report["iteration"]["relative_error"] == pytest.approx(-0.5)
    assert report["iteration"]["replayed_s"] == pytest.approx(0.31)
    assert report["iteration"]["measured_over_replayed"] == pytest.approx(2 * got["seconds"] / 0.31)
    assert set(report["per_task"]) == {"generate", "reference", "actor_train"}
    assert report["per_task_swarm"] == {}  # no phases published


def test_the_swarms_phases_become_tasks_and_the_sync_residue() -> None:
    phases = {"wait": 0.025, "generate": 0.006, "reference": 0.005, "train": 0.011, "publish": 0.0015}
    assert swarm_tasks(phases) == pytest.approx(
        {"generate": 0.006, "reference": 0.005, "actor_train": 0.011, "sync": 0.019 + 0.0015}
    )
    assert swarm_tasks({"wait": 0.02, "train": 0.01}) == {"actor_train": 0.01}  # older rollout peers
    assert swarm_tasks(None) == {}
    assert swarm_tasks({"train": 0.01, "average": 0.004}) == {"actor_train": 0.01, "average": 0.004}
    predicted = {
        "seconds": 0.02,
        "tasks": {"generate": 0.003, "reference": 0.006, "actor_train": 0.008},
        "sync": 0.0012,
        "transfers": 0.0002,
        "average": 0.0,
    }
    phases_replayed = {"iterations": 3, "rollout_shards": 2, "median_s": {"generate": 0.004}}
    report = prediction_report(predicted, phases_replayed, 0.05, None, phases)
    swarm = report["per_task_swarm"]
    assert swarm["sync"]["predicted_s"] == pytest.approx(0.0014)
    assert swarm["sync"]["measured_s"] == pytest.approx(0.0205)  # the wait beyond sampling + publish
    assert swarm["actor_train"]["relative_error"] == pytest.approx((0.008 - 0.011) / 0.011)
    assert "average" not in swarm  # a lone trainer publishes no average phase
    averaged = prediction_report(
        {**predicted, "average": 0.003}, phases_replayed, 0.05, None, {**phases, "average": 0.004}
    )["per_task_swarm"]["average"]
    assert averaged == pytest.approx({"predicted_s": 0.003, "measured_s": 0.004, "relative_error": -0.25})
    # phases without score/checkpoint: no loop to sum, so the polls' figure stands
    assert report["iteration"]["measured_s"] == 0.05 and report["iteration"]["measured_polls_s"] == 0.05
    loop = {**phases, "score": 0.0005, "checkpoint": 0.0}  # every phase of the trainer's loop
    looped = prediction_report(predicted, phases_replayed, 0.05, None, loop)["iteration"]
    assert looped["measured_s"] == pytest.approx(0.025 + 0.0005 + 0.005 + 0.011 + 0.0015)
    assert (
        looped["relative_error"] == pytest.approx(0.02 / 0.043 - 1)
        and "phase medians" in looped["measured_source"]
    )


def test_the_gradient_arms_predicted_ratio_is_the_compressions_on_one_roster() -> None:
    spec = parse_job_spec(job_spec(Settings(peers=3), staleness=0, iterations=5, name="g"))

    def arm(measured: float, predicted: float, sent: int) -> dict[str, float | int]:
        return {"measured_iteration_s": measured, "predicted_iteration_s": predicted, "averaging_bytes": sent}

    arms = {"dp-fp32": arm(0.020, 0.0140, 4_000_000), "dp-q8": arm(0.025, 0.0141, 1_100_000)}
    report = gradient_report(arms, spec, None, compressed_on_fp32_roster_s=0.0135)
    assert report["predicted_ratio_fp32_over_compressed"] == pytest.approx(0.0140 / 0.0135)
    assert report["predicted_ratio_own_rosters"] == pytest.approx(0.0140 / 0.0141)  # probes differ
    assert report["measured_ratio_fp32_over_compressed"] == pytest.approx(0.8)
    assert report["bytes_ratio_fp32_over_compressed"] == pytest.approx(4 / 1.1)
    assert gradient_report(arms, spec, None)["predicted_ratio_fp32_over_compressed"] is None


def test_a_kill_report_compares_the_pass_rate_before_the_kill_with_the_end() -> None:
    curve = [{"iteration": i, "pass_rate": 0.2 if i <= 40 else 0.7} for i in range(1, 101)]
    killed = {"peer": "peer2", "peer_id": "QmDead", "at_iteration": 40, "at_s": 3.5, "epoch": 1}
    view = {
        "state": "done",
        "allocation": {"stages": [["QmTrainer"]], "spares": ["QmOther"]},
        "churn": {"epoch": 3, "replans": []},  # the owner may list none of the re-plans it followed
        "progress": {"rl": {"iteration": 100, "shards_missing": 1, "staleness": [[0, 100 * 8 - 4]]}},
    }
    seen = [(3.0, 38), (3.5, 40), (9.0, 40), (15.5, 44), (20.0, 100)]
    report = kill_report(killed, curve, view, 8, seen)
    assert report["pass_rate_before"] == pytest.approx(0.2) and report["pass_rate_end"] == pytest.approx(0.7)
    assert report["rose_after"] and report["replanned_without_it"] and report["epoch_end"] == 3
    assert report["trained_again_after_s"] == pytest.approx(12.0)
    assert report["shards_missing"] == 1 and report["completions_not_trained"] == 4
    assert report["peer"] == "peer2" and report["window_iterations"] == 30
    # a final allocation that still holds the peer, or no later epoch: not re-planned without it
    kept = {**view, "allocation": {"stages": [["QmTrainer"]], "spares": ["QmDead"]}}
    assert not kill_report(killed, curve, kept, 8, seen)["replanned_without_it"]
    same = {**view, "churn": {"epoch": 1}}
    assert not kill_report(killed, curve, same, 8, seen)["replanned_without_it"]
