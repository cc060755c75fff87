"""``peerd bench wan`` on real daemons: a 4-peer shaped swarm trains the searched+compressed and the random arm."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from peerd.bench.wan import arm_spec, arms, regime, scenario_path, shaped_scenario, wan
from peerd.pipeline.worker import PHASES
from peerd.sched.allocation import Allocation
from peerd.sched.placement import placement_seed, random_allocation
from peerd.sched.problem import Shape

pytestmark = pytest.mark.integration


def test_regime_arithmetic_matches_the_papers_ratio() -> None:
    spec = arm_spec(arms(1)[1], 8, 10)
    reg = regime(spec, 8, compute_full_s=0.4, cores=2)
    ref, tiny = reg["reference"], reg["tiny"]
    assert ref["bytes_per_tasklet_step"] == pytest.approx(2.149e9, rel=1e-3)
    assert ref["compute_s_per_tasklet_step"] == pytest.approx(2.955, rel=1e-3)
    assert tiny["compute_s_per_tasklet_step"] == pytest.approx(0.4 / 8 * 4)
    # scaled links give the tiny job the reference's bytes per (bandwidth x compute)
    bw = 1e9 / 8  # any link, bytes/s
    ref_ratio = ref["bytes_per_tasklet_step"] / bw / ref["compute_s_per_tasklet_step"]
    tiny_ratio = (
        tiny["bytes_per_tasklet_step"] / (bw * reg["bandwidth_factor"]) / tiny["compute_s_per_tasklet_step"]
    )
    assert tiny_ratio == pytest.approx(ref_ratio, rel=1e-9)
    shaped = shaped_scenario(scenario_path("world-wide"), [f"peer{i}" for i in range(8)], 0.01, 0.05)
    assert [d["region"] for d in shaped["devices"]][:3] == ["Oregon", "Virginia", "Ohio"]
    assert shaped["regions"]["bandwidth_mbps"][0][1] == pytest.approx(7.9)
    four = shaped_scenario(scenario_path("regional"), [f"p{i}" for i in range(8)], 1.0, 1.0)
    assert [d["region"] for d in four["devices"]] == ["Virginia"] * 2 + ["Oregon"] * 2 + [
        "California"
    ] * 2 + ["Ohio"] * 2


@pytest.mark.slow
@pytest.mark.timeout(480)  # ~2.5 min on an idle 2-core machine; 6.7 min measured at load 23
def test_quick_wan_bench_trains_the_searched_and_the_random_arm() -> None:
    result = wan(peers=4, seeds=1, steps=5, only=("a", "c"))
    assert result["peers"] == 4 and result["regime"]["bandwidth_factor"] > 0
    by_arm = {r["arm"]: r for r in result["arms"]}
    assert set(by_arm) == {"a-peerd", "c-random-s0"}, result["arms"]
    for r in by_arm.values():
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["predicted_s_per_step"] > 0
        assert math.isfinite(r["measured_over_predicted"])
        assert len(r["loss_vs_tokens"]) >= 3 and all(math.isfinite(loss) for _, loss in r["loss_vs_tokens"])
    a, c = by_arm["a-peerd"], by_arm["c-random-s0"]
    assert a["compression_ratio"] > 1.5  # 4/8-bit activations and 8-bit gradients on the wire
    # uncompressed: the frames carry the fp32 bytes plus headers. Raw bytes are counted with the
    # frames as they leave (before, from steps done, they ran ahead of shares and gradients
    # still in flight: 1.050 at 5 steps)
    assert 0.95 < c["compression_ratio"] <= 1.0
    # what the tasklets measured: every tasklet of the 2 x 2 shape, its step split into phases
    for r in (a, c):
        measured = r["measured_phases"]
        assert measured["tasklets"] == 4, measured
        assert set(measured["mean_s_per_step"]) == set(PHASES)
        assert measured["dominant"] in measured["mean_s_per_step"]
        # the daemons' CPU over the steady steps the polls timed (a /proc machine), and the regime it implies
        host = r["host_cpu"]
        # the step time from the tasklets' own clocks: their phases and what runs between steps
        assert r["s_per_step_source"] == "tasklets" and len(measured["by_tasklet"]) == 4
        for t in measured["by_tasklet"]:
            assert t["s_per_step"] >= 0.99 * sum(t["phases_s"].values()), t
        assert r["s_per_step_tasklets"]["min"] <= r["s_per_step"] <= r["s_per_step_tasklets"]["max"]
        # the commit scored again on the roster the owner's status shows, with the cost's parts
        parts = r["prediction"]["parts"]
        assert parts["pp"] > 0 and parts["dp"] > 0 and parts["norm"] > 0, r["prediction"]
        assert len(r["prediction"]["roster"]) == 4
        if Path("/proc/self/stat").exists():  # where a message's cost can be measured
            # every daemon declares what a message costs this machine, and the cost has the floor of
            # the layout's CPU work on the cores they share
            for entry in r["prediction"]["roster"]:
                assert entry["profile"]["host"] and entry["profile"]["message_s"] > 0, entry["profile"]
                assert entry["profile"]["codec_s"] > 0, entry["profile"]  # the codec calls priced too
            assert parts["host_cpu"] > 0, parts
        if r["s_per_step_polls"]:
            assert host["swarm_cpu_s_per_step"] > 0 and 0 < host["swarm_share_of_cores"] <= 1.25, host
            assert host["machine_share_of_cores"] > 0 and host["regime"], host
            # split by process: the daemons, their DHT processes and p2pd all worked; the parts add up
            roles = host["swarm_cpu_s_per_step_by_role"]
            assert roles["daemon"] > 0 and roles["dht"] > 0 and roles["p2pd"] > 0, roles
            assert sum(roles.values()) == pytest.approx(host["swarm_cpu_s_per_step"], rel=0.1), host
    # the random arm trained exactly the seeded order every peer derives from public data
    commit = c["commit"]
    expected = random_allocation(commit["roster"], Shape(2, 2), placement_seed(c["job_id"], 0))
    assert Allocation.from_plain(commit["stages"], commit["spares"]).canonical() == expected.canonical()
    assert result["ratios"]["a_over_c_tokens_per_s"] > 0
    if Path("/proc/self/stat").exists():
        assert result["machine"]["message_us"] > 0 and result["machine"]["wire_byte_ns"] > 0
    cross = result["crossover"]  # predicted from the regime, for arms a and d at this size
    assert cross["slowest_link_mbps"] > 0 and cross["predicted_a_over_d_tokens_per_s"] > 0, cross


def test_quick_sets_defaults_that_explicit_options_override(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    import peerd.bench.wan as bench

    seen: list[dict] = []

    def fake_wan(**kwargs):  # the CLI's parsing only: the real run is the smoke test above
        seen.append(kwargs)
        return {"arms": [], "seconds": 0.0}

    monkeypatch.setattr(bench, "wan", fake_wan)
    runner = CliRunner()
    assert runner.invoke(bench.command, ["--quick"]).exit_code == 0
    assert runner.invoke(bench.command, ["--quick", "--steps", "12", "--peers", "8"]).exit_code == 0
    assert (seen[0]["peers"], seen[0]["seeds"], seen[0]["steps"]) == (4, 1, 8)
    assert (seen[1]["peers"], seen[1]["seeds"], seen[1]["steps"]) == (8, 1, 12)
    assert seen[0]["link_scale"] == 1.0
    assert runner.invoke(bench.command, ["--quick", "--link-scale", "0.25"]).exit_code == 0
    assert seen[2]["link_scale"] == 0.25
    assert runner.invoke(bench.command, ["--link-scale", "0"]).exit_code == 2
    for peers in ("5", "6", "12"):  # arm d could not split the batch over 6 or 12 replicas
        bad = runner.invoke(bench.command, ["--peers", peers])
        assert bad.exit_code == 2 and "one of 4, 8, 16" in bad.output, bad.output
