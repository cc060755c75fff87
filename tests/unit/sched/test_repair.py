"""Incremental re-planning: repair after devices leave or join, hysteresis before a fresh plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from peerd.errors import ConfigError
from peerd.sched.planner import plan
from peerd.sched.repair import repair, replan
from peerd.sched.scenario import Device, ModelShape, Regions, Scenario, TrainingSpec, load_scenario

SCENARIOS = Path(__file__).resolve().parents[3] / "configs" / "scenarios"


def _swap_out(sc, gone: set[str], newcomers: list[tuple[str, str]]):
    template = sc.devices[0]
    devices = [d for d in sc.devices if d.id not in gone]
    devices += [dataclasses.replace(template, id=i, region=r) for i, r in newcomers]
    return dataclasses.replace(sc, devices=devices)


def test_repair_replaces_lost_devices_and_keeps_the_rest():
    sc = load_scenario(SCENARIOS / "dtfm-case3.yaml")
    before = plan(sc, "dtfm", seed=0, generations=2, time_budget=60)
    region = {d.id: d.region for d in sc.devices}
    lost = [before.allocation.stages[2][3], before.allocation.stages[5][0]]
    after_sc = _swap_out(sc, set(lost), [("new-a", region[lost[0]]), ("new-b", region[lost[1]])])
    fixed = repair(after_sc, before.allocation, "dtfm")
    assert set(fixed.allocation.devices) == {d.id for d in after_sc.devices}
    # Same regions came back: the repair is as good as before and moves nobody else.
    assert fixed.total == pytest.approx(before.total)
    kept = sum(
        len(set(a) & set(b)) for a, b in zip(before.allocation.stages, fixed.allocation.stages, strict=True)
    )
    assert kept == 62
    assert "2 devices gone" in fixed.note


def test_repair_drops_a_damaged_replica_when_spares_are_allowed():
    sc = Scenario(
        name="rack",
        regions=Regions(names=["dc"], delay_ms=[[0.5]], bandwidth_mbps=[[25000.0]]),
        devices=[Device(id=f"gpu{i:02d}", region="dc", tflops=100.0, memory_gb=40.0) for i in range(16)],
        model=ModelShape(layers=8, hidden=1024, seq=512),
        training=TrainingSpec(global_batch=48, d_pp=4),
    )
    before = plan(sc, "peerd", seed=0, generations=1, time_budget=60)
    assert (before.shape.d_pp, before.shape.d_dp) == (4, 4)
    gone = before.allocation.pipelines()[1][2]
    fixed = repair(_swap_out(sc, {gone}, []), before.allocation, "peerd")
    assert (fixed.shape.d_pp, fixed.shape.d_dp) == (4, 3)  # one replica dropped, its 3 survivors spare
    assert gone not in fixed.allocation.devices and len(fixed.allocation.spares) == 3
    survivors = [p for j, p in enumerate(before.allocation.pipelines()) if j != 1]
    assert sorted(map(tuple, fixed.allocation.pipelines())) == sorted(map(tuple, survivors))


def test_replan_keeps_the_repair_unless_a_fresh_plan_is_clearly_better():
    sc = load_scenario(SCENARIOS / "dtfm-case2.yaml")
    before = plan(sc, "dtfm", seed=0, generations=1, time_budget=60)
    region = {d.id: d.region for d in sc.devices}
    lost = before.allocation.stages[0][0]
    after_sc = _swap_out(sc, {lost}, [("fresh", region[lost])])
    result = replan(after_sc, before.allocation, "dtfm", time_budget=3.0)
    assert "kept" in result.note and result.total == pytest.approx(before.total)
    # A fixed shape that no longer matches the roster is bad input, not a crash.
    with pytest.raises(ConfigError) as info:
        repair(_swap_out(sc, {lost}, []), before.allocation, "dtfm")
    assert info.value.field == "training.d_dp"
