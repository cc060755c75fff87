"""``peerd bench rl-swarm`` on real daemons: a 3-iteration GRPO job on 3 peers gives every section of its
JSON, with the colocated and the gradient-compression comparisons."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from peerd.bench.rl_swarm import Settings, rl_swarm

pytestmark = pytest.mark.integration


@pytest.mark.slow
@pytest.mark.timeout(600)  # 2.75 min measured on a shared 2-core machine at load ~8
def test_a_tiny_rl_swarm_run_reports_curve_heldout_and_prediction(tmp_path: Path) -> None:
    s = Settings(
        peers=3,
        iterations=3,
        warmup_steps=40,
        prompts=12,  # an update's 6 groups: 2 per trainer of the colocated arm, 3 per trainer of the dp arms
        eval_problems=32,
        job_timeout_s=300,
        compare_colocated=True,
        compare_iterations=3,  # the main job is the consensus arm
        compare_gradient_bits=8,
    )
    png = tmp_path / "curve.png"
    result = rl_swarm(s, str(png))
    assert {"curve", "heldout", "prediction", "regime", "allocation", "rl_final", "wall_s"} <= set(result)
    assert [p["iteration"] for p in result["curve"]] == [1, 2, 3]
    assert all(0.0 <= p["pass_rate"] <= 1.0 for p in result["curve"])
    # the consensus chooses the trainers (parallel.d_dp auto: 1 or 2 here, a rollout peer being kept);
    # the cost model may leave a peer out when its share costs more than it adds
    trainers, rollout_peers = result["allocation"]["trainer"], result["allocation"]["rollout_peers"]
    assert 1 <= len(trainers) <= 2 and 1 <= len(rollout_peers) <= 3 - len(trainers)

    final = result["rl_final"]
    assert final["version"] == 3 and final["staleness"] == [
        [0, 3 * s.prompts * s.group_size]
    ]  # sync: on-policy

    held = result["heldout"]
    assert held["end_source"]["fetched"]["step"] == 3
    assert held["target_pass_rate"] == pytest.approx(min(3 * held["start"]["pass_rate"], 0.6))
    assert held["target_met"] == (
        held["end"]["pass_rate"] >= held["target_pass_rate"]
        and held["end"]["pass_rate"] > held["start"]["pass_rate"]
    )

    pred = result["prediction"]
    assert set(pred["per_task"]) == {"generate", "reference", "actor_train"}
    for row in pred["per_task"].values():
        assert row["predicted_s"] > 0 and row["measured_s"] > 0 and math.isfinite(row["relative_error"])
    assert pred["iteration"]["predicted_s"] > 0 and pred["committed_cost_s"] > 0
    # the roster rebuilt from the owner's status scores near the cost the consensus committed
    assert 0.5 < pred["rebuilt_over_committed"] < 2.0
    regime = result["regime"]
    assert regime["cores"] >= 1 and regime["device"] == "cpu" and len(regime["load_average_start"]) == 3
    if result.get("png"):  # matplotlib is optional
        assert png.stat().st_size > 0

    placed = result["compare_colocated"]
    assert len(placed["colocated"]["trainers"]) == 3 and placed["colocated"]["rollout_peers"] == []
    assert placed["consensus"]["trainers"] == result["allocation"]["trainer"]
    for arm in ("consensus", "colocated"):
        assert placed[arm]["measured_iteration_s"] > 0 and placed[arm]["predicted_iteration_s"] > 0
        assert placed[arm]["rewards_last"][0] == 3
    assert placed["measured_ratio_colocated_over_consensus"] > 0

    compressed = result["compare_gradient_bits"]
    for arm in ("dp-fp32", "dp-q8"):
        assert len(compressed[arm]["trainers"]) == 2 and compressed[arm]["rewards_last"][0] == 3
        assert compressed[arm]["measured_iteration_s"] > 0 and compressed[arm]["predicted_iteration_s"] > 0
    # 6 updates' gradients at ~0.26 of fp32, beside the start weights both arms average exact
    assert compressed["bytes_ratio_fp32_over_compressed"] > 1.5
    # on one roster and the same roles, fewer bytes to average can only be faster
    assert compressed["predicted_ratio_fp32_over_compressed"] > 1.0
    assert compressed["predicted_ratio_own_rosters"] > 0
    assert compressed["regime"]["fp32_gradient_bytes_per_iteration"] > 0
