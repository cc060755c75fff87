"""RL searches: exact MILP = brute force on tiny instances, hybrid determinism, plan memory, baselines."""

from __future__ import annotations

import dataclasses

import pytest

from peerd.bench.rl_scheduler import medium_cases
from peerd.errors import ConfigError, InfeasibleError
from peerd.sched.rl.baselines import streamrl_like, verl_like
from peerd.sched.rl.brute import brute_force
from peerd.sched.rl.cluster import Cluster, rl_scenario
from peerd.sched.rl.evaluate import Evaluator
from peerd.sched.rl.exact import ExactConfig, solve
from peerd.sched.rl.hybrid import HybridConfig, search
from peerd.sched.rl.planner import plan_rl, with_overrides
from peerd.sched.rl.workflow import Workflow, timing_paths
from peerd.sched.rl.workload import Launches, ModelSize, Workload
from peerd.sched.scenario import Device, Regions, Scenario

SMALL = ModelSize(params=1.5e9, layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128)


def tiny(edge_mbps: float = 1000.0, l4: int = 3) -> Scenario:
    """Two A100s and an L40S in one site, ``l4`` L4s at an edge site."""
    devs = [
        Device(id=f"a{i}", region="dc", tflops=312, memory_gb=80, memory_bandwidth_gb_s=2039)
        for i in range(2)
    ]
    devs.append(Device(id="s0", region="dc", tflops=362, memory_gb=48, memory_bandwidth_gb_s=864))
    devs += [
        Device(id=f"l{i}", region="edge", tflops=121, memory_gb=24, memory_bandwidth_gb_s=300)
        for i in range(l4)
    ]
    regions = Regions(
        names=["dc", "edge"],
        delay_ms=[[0.01, 10.0], [10.0, 0.01]],
        bandwidth_mbps=[[100000.0, edge_mbps], [edge_mbps, 100000.0]],
    )
    return Scenario(devices=devs, regions=regions, name="tiny")


def workload(**kw) -> Workload:
    return Workload(actor=SMALL, prompts=64, **kw)


def test_groupings_and_paths():
    grpo = Workflow.of(workload())
    assert grpo.units == (("generate",), ("reference",), ("actor_train",))
    assert len(grpo.groupings(3)) == 5 and len(grpo.groupings(1)) == 1
    ppo = Workflow.of(workload(algo="ppo"))
    assert ("critic_infer", "critic_train") in ppo.units and len(ppo.groupings(4)) == 15
    paths = timing_paths(grpo, (("generate",), ("reference", "actor_train")))
    # gen -> ref -> train (with the chain ref -> train in group 1) and gen -> train directly
    full = {p.tasks for p in paths if not p.cycle}
    assert full == {("generate", "reference", "actor_train"), ("generate", "actor_train")}
    assert all(p.sync for p in paths if p.cycle)  # generation and training apart: the loop syncs
    colocated = timing_paths(grpo, (("generate", "reference", "actor_train"),))
    assert not any(p.sync or p.transfers for p in colocated)
    # a learned reward model of another size is one more unit, on the path to training
    judge = ModelSize(params=0.5e9, layers=24, hidden=896, heads=14, kv_heads=2, head_dim=64)
    rewarded = workload(reward=judge)
    flow = Workflow.of(rewarded)
    assert ("reward",) in flow.units and ("generate", "reward", "actor_train") in {
        p.tasks for p in timing_paths(flow, flow.groupings(1)[0])
    }
    ev = Evaluator(Cluster.of(rl_scenario(tiny(), rewarded)), rewarded)
    alone = ev.score((flow.tasks,), [(2, 1, 3)]).seconds
    without = Evaluator(Cluster.of(rl_scenario(tiny(), workload())), workload())
    assert alone > without.score((grpo.tasks,), [(2, 1, 3)]).seconds  # scoring takes time


@pytest.mark.parametrize(
    "kw",
    [{}, {"staleness": 1}, {"algo": "ppo"}, {"launches": Launches(load_bytes=2e10, publish_bytes=1e10)}],
    ids=["grpo-sync", "grpo-async1", "ppo-sync", "grpo-sync-weights-host-work"],
)
def test_exact_equals_brute_force(kw):
    w = workload(**kw)
    sc = tiny(l4=3) if not kw.get("algo") else tiny(l4=2)
    cl = Cluster.of(rl_scenario(sc, w))
    _, _, best = brute_force(Evaluator(cl, w))
    exact = solve(Evaluator(cl, w), ExactConfig())
    assert exact.score.seconds == pytest.approx(best.seconds, rel=1e-6)
    assert exact.gap <= 1e-6
    assert exact.lower_bound == pytest.approx(best.seconds, rel=1e-6)


def test_async_overlaps_generation_with_training():
    sync = solve(Evaluator(Cluster.of(rl_scenario(tiny(), workload())), workload()), ExactConfig())
    w1 = workload(staleness=1)
    one = solve(Evaluator(Cluster.of(rl_scenario(tiny(), w1)), w1), ExactConfig())
    assert one.score.seconds < sync.score.seconds
    # tasks of one group cannot overlap: the async optimum has groups that work side by side
    assert len(one.grouping) >= 2


def test_hybrid_is_deterministic_and_reaches_the_tiny_optimum():
    w = workload()
    cl = Cluster.of(rl_scenario(tiny(), w))
    a = search(Evaluator(cl, w), HybridConfig(budget=120, seed=4))
    b = search(Evaluator(cl, w), HybridConfig(budget=120, seed=4))
    assert (a.grouping, a.labels, a.score, a.history) == (b.grouping, b.labels, b.score, b.history)
    best = brute_force(Evaluator(cl, w))[2]
    assert a.score.seconds == pytest.approx(best.seconds, rel=1e-9)
    assert all(later[1] <= earlier[1] for earlier, later in zip(a.history, a.history[1:], strict=False))


@pytest.mark.parametrize("seed", [0, 2])
def test_the_final_polish_gets_a_medium_async_instance_near_the_exact_optimum(seed):
    """24 GPUs in three regions, async: the GA alone stalled 6.6-8.9 % above the MILP's optimum
    (seeds 0 and 2, budgets up to 1500); the polish's class moves reach it within 5 % at budget 300."""
    sc, w = next(c for c in medium_cases() if c[0].name == "medium-24-async")
    cl = Cluster.of(rl_scenario(sc, w))
    exact = solve(Evaluator(cl, w), ExactConfig())
    polished = search(Evaluator(cl, w), HybridConfig(budget=300, seed=seed))
    unpolished = search(Evaluator(cl, w), HybridConfig(budget=300, seed=seed, polish=0.0))
    assert polished.score.seconds <= 1.05 * exact.score.seconds
    assert unpolished.score.seconds > 1.05 * exact.score.seconds
    assert polished.history[-1][0] <= 300  # the polish is paid from the budget, not on top


def test_plan_reports_memory_within_limits_and_baselines():
    rl = rl_scenario(tiny(), workload(name="small"))
    r = plan_rl(rl, "hybrid", budget=60)
    d = r.to_dict()
    assert d["iteration_seconds"] == pytest.approx(r.seconds) and d["workload"] == "small"
    used = {dev for g in d["groups"] for dev in g["devices"]}
    assert used | set(d["idle"]) == {dev.id for dev in rl.scenario.devices}
    assert d["memory"] and all(m["used_gb"] <= m["usable_gb"] for m in d["memory"].values())
    for g in d["groups"]:
        for lay in g["layouts"].values():
            assert lay["dp"] * lay["pp"] * lay["tp"] == len(g["devices"])
    assert d["baselines"]["verl_like"]["groups"] == [["generate", "reference", "actor_train"]]
    assert d["baselines"]["verl_like"]["speedup"] >= 1.0  # verl's plan is in the hybrid's space
    exact = plan_rl(rl, "exact", baselines=False)
    assert exact.seconds <= r.seconds + 1e-9 and exact.search["gap"] <= 1e-6


def test_baselines_split_by_gpu_model():
    w = workload()
    cl = Cluster.of(rl_scenario(tiny(), w))
    grouping, counts, score = verl_like(cl, w)
    assert len(grouping) == 1 and sum(counts[0]) == 6
    grouping, counts, score = streamrl_like(cl, w)
    assert grouping[0] == ("generate",)
    gen, rest = counts
    # each pool is whole GPU models: a class is never split between the pools
    assert all(g == 0 or r == 0 for g, r in zip(gen, rest, strict=True)) and score.seconds > 0


def test_infeasible_workload_names_the_task_and_the_shortfall():
    big = ModelSize(params=30e9, layers=48, hidden=6144, heads=48, kv_heads=8, head_dim=128)
    devs = [
        Device(id=f"l{i}", region="dc", tflops=121, memory_gb=24, memory_bandwidth_gb_s=300) for i in range(3)
    ]
    one_site = Regions(names=["dc"], delay_ms=[[0.01]], bandwidth_mbps=[[100000.0]])
    sc = Scenario(devices=devs, regions=one_site, name="small-l4")
    # 30e9 x 16 bytes = 480 GB > 3 x 24 GB: refused when the scenario is built
    with pytest.raises(ConfigError) as err:
        rl_scenario(sc, Workload(actor=big))
    assert err.value.errors[0].field == "workload.actor.params"
    # fits on paper (16 B/param x 4e9 = 64 GB < 65 GB), yet some task fits under no layout
    mid = dataclasses.replace(SMALL, params=4e9)
    with pytest.raises(
        InfeasibleError, match=r"small-l4: (generate|reference|actor_train) needs [0-9.]+ GB more on l\d"
    ):
        plan_rl(rl_scenario(sc, Workload(actor=mid, prompts=8)), "hybrid", budget=10, baselines=False)


def test_staleness_and_algo_overrides_are_checked():
    with pytest.raises(ConfigError) as err:
        with_overrides(workload(), None, -1)
    assert err.value.field == "staleness"
    with pytest.raises(ConfigError) as err:
        with_overrides(workload(), "dpo", None)
    assert err.value.field == "algo"
    assert with_overrides(workload(), "ppo", 2).staleness == 2


def test_iteration_time_combines_tasks_transfers_and_sync_along_the_graph():
    sc = tiny(edge_mbps=800.0, l4=2)
    grouping = (("generate",), ("reference", "actor_train"))
    for k in (0, 2):
        w = workload(staleness=k)
        ev = Evaluator(Cluster.of(rl_scenario(sc, w)), w)
        gen_counts, rest_counts = (0, 0, 2), (2, 1, 0)  # classes: A100 x2, L40S, L4 x2 (edge)
        gen, rest = ev.group(grouping[0], gen_counts), ev.group(grouping[1], rest_counts)
        # every transfer crosses the 800 Mbit/s, 10 ms edge link: 1e8 bytes/s
        tokens = 64 * 8 * 2048 * 4
        transfer = 0.010 + tokens / 1e8
        # sync: 1.5e9 x 2 bytes over that link, or relayed between the two L4s (100 Gbit/s, 0.01 ms)
        actor = 1.5e9 * 2
        sync = max(0.010 + actor / 1e8, actor / 12.5e9 + 0.01e-3)
        loop = (
            gen.seconds("generate")
            + transfer
            + rest.seconds("reference")
            + rest.seconds("actor_train")
            + sync
        )
        expected = loop if k == 0 else max(gen.busy, rest.busy, loop / (k + 1))
        assert ev.score(grouping, [gen_counts, rest_counts]).seconds == pytest.approx(expected, rel=1e-12)
