"""The dtfm yardstick: hand-computed cases, the DT-FM numbers, and brute force on tiny clusters."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from peerd.errors import ConfigError
from peerd.sched.allocation import Allocation
from peerd.sched.cost_dtfm import DtfmObjective
from peerd.sched.layout import score_allocation
from peerd.sched.planner import plan
from peerd.sched.problem import Problem, Shape
from peerd.sched.scenario import Scenario, load_scenario
from peerd.sched.synthetic import random_cluster

SCENARIOS = Path(__file__).resolve().parents[3] / "configs" / "scenarios"


def two_regions(**training) -> Scenario:
    # a, b in r0; c, d in r1. Intra: 0 ms, 8 Gbit/s (1 GB/s); cross: 10 ms, 800 Mbit/s (0.1 GB/s).
    return Scenario.from_mapping(
        {
            "regions": {
                "names": ["r0", "r1"],
                "delay_ms": [[0, 10], [10, 0]],
                "bandwidth_mbps": [[8000, 800], [800, 8000]],
            },
            "devices": [
                {"id": i, "region": r} for i, r in (("a", "r0"), ("b", "r0"), ("c", "r1"), ("d", "r1"))
            ],
            "training": {
                "global_batch": 8,
                "d_pp": 2,
                "d_dp": 2,
                "c_dp_bytes": 1e9,
                "c_pp_bytes": 2e8,
                **training,
            },
        }
    )


def test_hand_computed_two_by_two():
    obj = DtfmObjective(Problem(two_regions()), Shape(2, 2))
    # Groups inside regions: dp = 2 * (0 + 1e9 / (2 * 1e9)) = 1.0; pipeline edge crosses: 0.01 + 2e8 / 1e8 = 2.01.
    inside = score_allocation(obj, Allocation((("a", "b"), ("c", "d"))))
    assert inside.total == pytest.approx(1.0 + 2 * 2.01)
    assert inside.parts == pytest.approx({"dp": 1.0, "pp": 2.01})
    # Groups across regions: dp = 2 * (0.01 + 1e9 / (2 * 1e8)) = 10.02; edge inside regions: 2e8 / 1e9 = 0.2.
    across = score_allocation(obj, Allocation((("a", "c"), ("b", "d"))))
    assert across.total == pytest.approx(10.02 + 2 * 0.2)
    # The same groups with a bad replica pairing pay the cross link: pairing is part of the cost.
    crossed = score_allocation(obj, Allocation((("a", "c"), ("d", "b"))))
    assert crossed.total == pytest.approx(10.02 + 2 * 2.01)
    assert plan(two_regions(), "dtfm", generations=2, time_budget=30).total == pytest.approx(5.02)


def test_sizes_derived_from_the_model_when_not_given():
    sc = Scenario.from_mapping(
        {
            "devices": [{"id": f"d{i}"} for i in range(4)],
            "links": [
                {"src": f"d{i}", "dst": f"d{j}", "delay_ms": 1, "bandwidth_mbps": 1000}
                for i in range(4)
                for j in range(4)
                if i != j
            ],
            "model": {"layers": 4, "hidden": 16, "seq": 8, "params": 4000},
            "training": {"global_batch": 6, "d_pp": 2, "d_dp": 2},
        }
    )
    obj = DtfmObjective(Problem(sc), Shape(2, 2))
    assert obj.c_dp == pytest.approx(4000 / 2 * 4)  # params of one stage x fp32 gradients
    assert obj.c_pp == pytest.approx(6 / 2 * 8 * 16 * 2)  # tasklet sequences x seq x hidden x fp16


def test_missing_sizes_without_model_is_a_config_error():
    sc = two_regions(c_pp_bytes=None)
    with pytest.raises(ConfigError) as info:
        DtfmObjective(Problem(sc), Shape(2, 2))
    assert info.value.field == "training.c_pp_bytes"


def test_dtfm_case0_layouts_reproduce_the_reference_numbers():
    sc = load_scenario(SCENARIOS / "dtfm-case0.yaml")
    obj = DtfmObjective(Problem(sc), Shape(8, 8))
    ids = [d.id for d in sc.devices]  # instance i holds d(8i) .. d(8i+7)
    # Pipelines inside instances: each group takes one GPU per instance (the reference's 3.440).
    transposed = Allocation(tuple(tuple(ids[i * 8 + k] for i in range(8)) for k in range(8)))
    cost = score_allocation(obj, transposed)
    assert cost.total == pytest.approx(3.440, abs=5e-4)
    assert cost.parts["dp"] == pytest.approx(2 * 7 * 0.65e9 * 8 / (8 * 3.125e9))
    # Groups inside instances: every pipeline edge crosses instances.
    grouped = Allocation(tuple(tuple(ids[k * 8 + i] for i in range(8)) for k in range(8)))
    assert score_allocation(obj, grouped).total == pytest.approx(
        0.091 + 2 * 7 * 0.4712492 * 8 / 3.125, abs=1e-3
    )


def _naive_total(sc: Scenario, grid: list[list[str]], c_dp: float, c_pp: float) -> float:
    """The formula of scheduler.md written out directly from delay_s / bandwidth_bps."""
    d_dp = len(grid[0])

    def t(a, b, size):
        return sc.delay_s(a, b) + 8 * size / sc.bandwidth_bps(a, b)

    dp = max(sum(2 * t(d, e, c_dp / d_dp) for e in row if e != d) for row in grid for d in row)
    pp = sum(max(t(grid[k][j], grid[k + 1][j], c_pp) for j in range(d_dp)) for k in range(len(grid) - 1))
    return dp + 2 * pp


@pytest.mark.parametrize(("d_pp", "d_dp", "seed"), [(3, 2, 1), (2, 3, 2), (3, 2, 3), (4, 2, 5)])
def test_plan_finds_the_brute_force_optimum_on_tiny_clusters(d_pp, d_dp, seed):
    sc = random_cluster(d_pp * d_dp, np.random.default_rng(seed), d_pp=d_pp)
    obj = DtfmObjective(Problem(sc), Shape(d_pp, d_dp))
    ids = [d.id for d in sc.devices]
    best = np.inf
    for perm in itertools.permutations(ids):  # every stage order and every replica pairing
        grid = [list(perm[k * d_dp : (k + 1) * d_dp]) for k in range(d_pp)]
        best = min(best, _naive_total(sc, grid, obj.c_dp, obj.c_pp))
    result = plan(sc, "dtfm", seed=seed, generations=3, time_budget=60)
    assert result.total == pytest.approx(best, rel=1e-9)
    # The reported cost is the naive formula of the reported allocation.
    assert _naive_total(sc, [list(s) for s in result.allocation.stages], obj.c_dp, obj.c_pp) == pytest.approx(
        result.total
    )


def test_missing_link_pairs_need_a_fallback():
    data = {
        "devices": [{"id": d} for d in "abcd"],
        "links": [
            {"src": s, "dst": d, "delay_ms": 5, "bandwidth_mbps": 1000, "symmetric": True}
            for s, d in (("a", "b"), ("b", "c"), ("c", "d"), ("a", "c"), ("b", "d"))
        ],  # a <-> d never measured
        "training": {"global_batch": 4, "d_pp": 2, "d_dp": 2, "c_dp_bytes": 1e8, "c_pp_bytes": 1e8},
    }
    with pytest.raises(ConfigError) as info:
        plan(Scenario.from_mapping(data), "dtfm", time_budget=5)
    assert info.value.field == "links" and "estimate_missing" in str(info.value)
    estimated = plan(
        Scenario.from_mapping({**data, "estimate_missing": True}), "dtfm", generations=1, time_budget=30
    )
    assert estimated.total > 0
