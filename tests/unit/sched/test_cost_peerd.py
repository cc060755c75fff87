"""The peerd model: reduction to the yardstick, uneven layers, memory, spares, vectorised moves."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from peerd.errors import ConfigError, InfeasibleError
from peerd.sched.allocation import Allocation
from peerd.sched.cost_dtfm import DtfmObjective
from peerd.sched.cost_peerd import PeerdObjective, split_layers
from peerd.sched.hosts import HostShare
from peerd.sched.layout import score_allocation
from peerd.sched.objective import Cost, Objective
from peerd.sched.planner import plan
from peerd.sched.problem import Problem, Shape
from peerd.sched.scenario import Device, ModelShape, Regions, Scenario, TrainingSpec, load_scenario
from peerd.sched.synthetic import random_cluster

SCENARIOS = Path(__file__).resolve().parents[3] / "configs" / "scenarios"
NONE = np.array([], dtype=np.intp)


def _identical_free_compute(seed: int, n: int = 16, d_pp: int = 4) -> Scenario:
    sc = random_cluster(n, np.random.default_rng(seed), d_pp=d_pp)
    devices = [dataclasses.replace(d, tflops=1e15, memory_gb=1e6) for d in sc.devices]
    d_dp = n // d_pp
    training = TrainingSpec(
        global_batch=d_dp, micro_batch=1, d_pp=d_pp, d_dp=d_dp, c_dp_bytes=3e8, c_pp_bytes=2e8
    )
    return dataclasses.replace(sc, devices=devices, training=training)


def test_reduces_to_dtfm_with_identical_devices_and_free_compute():
    """Two replicas: a member's one exchange is the same whether the exchanges are summed (DT-FM)
    or run at once (peerd)."""
    sc = _identical_free_compute(3, d_pp=8)
    problem = Problem(sc)
    dtfm, peerd = DtfmObjective(problem, Shape(8, 2)), PeerdObjective(problem, Shape(8, 2))
    rng = np.random.default_rng(0)
    a, b = [], []
    for _ in range(30):
        groups = list(rng.permutation(16).reshape(8, 2))
        e1 = dtfm.evaluate(groups, NONE)
        assert peerd.evaluate(groups, NONE, order=e1.order).cost.total == pytest.approx(
            e1.cost.total, rel=1e-9
        )
        a.append(e1.cost.total)
        b.append(peerd.evaluate(groups, NONE).cost.total)
    assert np.array_equal(np.argsort(a), np.argsort(b))  # same ranking


def test_split_is_min_max_and_even_when_compute_is_free():
    n, short = split_layers(np.array([[0.0, 0.0, 0.0]]), np.array([[99, 99, 99]]), 9)
    assert n.tolist() == [[3, 3, 3]] and short.tolist() == [0]
    n, _ = split_layers(np.array([[1.0, 2.0, 4.0]]), np.array([[99, 99, 99]]), 7)
    assert n.tolist() == [[4, 2, 1]]  # max 4: the fastest stage takes the most
    n, _ = split_layers(np.array([[1.0, 2.0]]), np.array([[2, 99]]), 8)
    assert n.tolist() == [[2, 6]]  # the fast stage is capped by its memory
    _, short = split_layers(np.array([[1.0, 1.0]]), np.array([[3, 3]]), 8)
    assert short.tolist() == [2]


def test_mixed_gpus_slower_stages_get_fewer_layers_and_memory_holds():
    sc = load_scenario(SCENARIOS / "mixed-gpus.yaml")
    sc = dataclasses.replace(sc, training=dataclasses.replace(sc.training, d_pp=4, d_dp=4))
    result = plan(sc, "peerd", seed=1, generations=2, time_budget=60)
    problem = Problem(sc)
    obj = PeerdObjective(problem, result.shape)
    rows = []
    for k, stage in enumerate(result.allocation.stages):
        idx = [problem.index[d] for d in stage]
        need = result.allocation.layers[k] * (obj.layer_static + obj.inflight[k] * obj.layer_act)
        assert need <= problem.memory_bytes[idx].min()
        rows.append((problem.tflops[idx].min(), result.allocation.layers[k]))
    assert sum(n for _, n in rows) == 24
    for ta, la in rows:
        for tb, lb in rows:
            if ta < tb:
                assert la <= lb
    assert len({n for _, n in rows}) > 1  # uneven devices, uneven layers


def _pair(memory_gb: float, layers: int = 8, **training) -> Scenario:
    return Scenario(
        name="pair",
        devices=[
            Device(id="fast", region="r", tflops=1000.0, memory_gb=memory_gb),
            Device(id="slow", region="r", tflops=10.0, memory_gb=80.0),
        ],
        regions=Regions(names=["r"], delay_ms=[[1.0]], bandwidth_mbps=[[10000.0]]),
        model=ModelShape(layers=layers, hidden=1024, seq=512, params=layers * 12 * 1024**2),
        training=TrainingSpec(global_batch=4, d_pp=2, d_dp=1, **training),
    )


def test_memory_caps_the_fast_device():
    per_layer = 12 * 1024**2 * 16 + 4 * 512 * 34 * 1024  # state + 1F1B first stage: 2 micro-batches in flight
    roomy = plan(_pair(80.0), "peerd", generations=1, time_budget=30)
    assert max(roomy.allocation.layers) == 7  # speed alone: nearly everything on the fast GPU
    tight = plan(_pair(2.2 * per_layer / 1e9), "peerd", generations=1, time_budget=30)
    fast_stage = next(k for k, s in enumerate(tight.allocation.stages) if s == ("fast",))
    assert tight.allocation.layers[fast_stage] <= 2
    assert sum(tight.allocation.layers) == 8


def test_no_split_fits_is_infeasible():
    sc = _pair(1.0)
    sc = dataclasses.replace(sc, devices=[dataclasses.replace(d, memory_gb=0.45) for d in sc.devices])
    with pytest.raises(InfeasibleError):
        plan(sc, "peerd", generations=1, time_budget=30)


def test_model_fitting_on_no_device_names_the_field():
    sc = dataclasses.replace(
        _pair(0.1), devices=[dataclasses.replace(d, memory_gb=0.1) for d in _pair(0.1).devices]
    )
    with pytest.raises(ConfigError) as info:
        plan(sc, "peerd", time_budget=5)
    assert info.value.field == "model"


def test_unknown_compute_is_a_config_error():
    sc = _pair(80.0)
    sc = dataclasses.replace(sc, devices=[sc.devices[0], dataclasses.replace(sc.devices[1], tflops=0.0)])
    with pytest.raises(ConfigError) as info:
        plan(sc, "peerd", time_budget=5)
    assert info.value.field == "devices[1].tflops"


def test_a_peer_behind_a_slow_link_is_left_out():
    devices = [Device(id=f"gpu{i}", region="dc", tflops=100.0, memory_gb=40.0) for i in range(8)]
    devices.append(Device(id="slow", region="home", tflops=100.0, memory_gb=40.0))
    sc = Scenario(
        name="slow-peer",
        regions=Regions(
            names=["dc", "home"],
            delay_ms=[[1.0, 30.0], [30.0, 1.0]],
            bandwidth_mbps=[[10000.0, 20.0], [20.0, 10000.0]],
        ),
        devices=devices,
        model=ModelShape(layers=24, hidden=2048, seq=1024, params=1.3e9),
        training=TrainingSpec(global_batch=32, micro_batch=1),
    )
    peerd = plan(sc, "peerd", generations=2, time_budget=60)
    assert "slow" in peerd.allocation.spares
    dtfm = plan(sc, "dtfm", generations=2, time_budget=60)
    assert "slow" in dtfm.allocation.devices  # the yardstick has no spares


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize(("d_pp", "d_dp"), [(3, 4), (4, 3), (1, 6)])
def test_vectorised_swaps_match_the_generic_rescoring(d_pp, d_dp, shared):
    sc = random_cluster(16, np.random.default_rng(d_pp), d_pp=2)
    sc = dataclasses.replace(
        sc, training=dataclasses.replace(sc.training, global_batch=d_dp * 4, norm_exchange=shared)
    )
    if shared:  # two oversubscribed machines and accelerators: a swap changes who slows whom
        from peerd.sched.scenario import LayerWork

        boxes = [HostShare("a", 2, 1), HostShare("b", 3, 2), None]
        sc = dataclasses.replace(
            sc,
            devices=[
                dataclasses.replace(
                    d,
                    host=boxes[i % 3],
                    launch_us=1.0 + i % 5,
                    memory_bandwidth_gb_s=10.0 + i,
                    # and, on the machines, what messages cost them and their daemons' idle load
                    **(
                        {"message_us": 100.0 + i, "wire_byte_ns": 1.0 + i % 3, "idle_cores": 0.05 * (i + 1)}
                        if boxes[i % 3] is not None
                        else {}
                    ),
                )
                for i, d in enumerate(sc.devices)
            ],
        )
        # and each layer's work beside its FLOPs, its update included, at every device's own costs
        work = [
            LayerWork(ops=50 + k, traffic_bytes=1e6 * k, update_ops=10, update_traffic_bytes=2e6 * (k + 1))
            for k in range(sc.model.layers)
        ]  # type: ignore[union-attr]
        sc = dataclasses.replace(sc, model=dataclasses.replace(sc.model, layer_work=work))
    obj = PeerdObjective(Problem(sc), Shape(d_pp, d_dp))
    rng = np.random.default_rng(0)
    perm = rng.permutation(16)
    grid, spares = perm[: d_pp * d_dp].reshape(d_pp, d_dp), np.sort(perm[d_pp * d_dp :])
    pairs = [(a, b) for a in range(grid.size) for b in range(16) if b >= grid.size or a // d_dp != b // d_dp]
    up, cand = np.array([a for a, _ in pairs]), np.array([b for _, b in pairs])
    fast = obj.swap_scores(grid, spares, up, cand)
    slow = Objective.swap_scores(obj, grid, spares, up, cand)
    np.testing.assert_allclose(fast, slow, rtol=1e-9)


def test_dtfm_vectorised_swaps_match_the_generic_rescoring():
    sc = random_cluster(24, np.random.default_rng(9), d_pp=4)
    obj = DtfmObjective(Problem(sc), Shape(4, 6))
    grid = np.random.default_rng(1).permutation(24).reshape(4, 6)
    pairs = [(a, b) for a in range(24) for b in range(24) if a // 6 != b // 6]
    up, cand = np.array([a for a, _ in pairs]), np.array([b for _, b in pairs])
    np.testing.assert_allclose(
        obj.swap_scores(grid, NONE, up, cand), Objective.swap_scores(obj, grid, NONE, up, cand), rtol=1e-9
    )


def test_a_stage_exchanges_the_gradients_of_its_own_layers_not_a_mean_layers() -> None:
    """An embedding-heavy first layer: the stage holding it averages more bytes (the wan bench's
    tiny GPT put two blocks on one stage and only the head on another; priced at the mean layer,
    the two-block stage's all-reduce came out 30 % short)."""
    layer_params = [8e6, 1e6, 1e6, 1e5]  # embedding, two blocks, head
    devices = [Device(id=f"d{i}", region="r", tflops=1e3, memory_gb=80.0) for i in range(4)]
    sc = Scenario(
        name="uneven-layers",
        devices=devices,
        regions=Regions(names=["r"], delay_ms=[[0.0]], bandwidth_mbps=[[100.0]]),
        model=ModelShape(layers=4, hidden=64, seq=32, layer_params=layer_params),
        training=TrainingSpec(global_batch=4, micro_batch=1, d_pp=2, d_dp=2, gradient_bytes=4),
    )
    obj = PeerdObjective(Problem(sc), Shape(2, 2))
    n = np.array([[2, 2]])
    assert obj.stage_grad_bytes(n).tolist() == [[9e6 * 4, 1.1e6 * 4]]
    assert obj.stage_grad_bytes(np.array([[1, 3]])).tolist() == [[8e6 * 4, 2.1e6 * 4]]
    cost = obj.evaluate([np.array([0, 1]), np.array([2, 3])], NONE).cost  # even split: 2 + 2 layers
    # the embedding's stage is the slowest: its 9e6 parameters, not twice the mean layer's 2.5e6
    assert cost.parts["dp"] == pytest.approx(9e6 * 4 * obj.bi[0, 1], rel=1e-9)


def test_tasklets_that_oversubscribe_a_machine_slow_each_other_and_the_plan_avoids_it() -> None:
    """Four CPU peers share a 2-core machine and a fifth has its own: a 2 x 2 job that leaves a
    co-hosted peer spare computes at 3/2 of its rate there, one that leaves the lone peer spare at 2."""
    box = HostShare("box", cores=2, threads=1)
    devices = [Device(id=f"p{i}", region="lan", tflops=0.05, memory_gb=8.0, host=box) for i in range(4)]
    devices.append(Device(id="own", region="lan", tflops=0.05, memory_gb=8.0, host=HostShare("own", 2)))
    sc = Scenario(
        name="one-box",
        regions=Regions(names=["lan"], delay_ms=[[0.1]], bandwidth_mbps=[[10000.0]]),
        devices=devices,
        model=ModelShape(layers=4, hidden=64, seq=64),
        training=TrainingSpec(global_batch=8, micro_batch=2, d_pp=2, d_dp=2),
    )
    obj = PeerdObjective(Problem(sc), Shape(2, 2))
    ix = obj.problem.index
    grid = np.array([[ix["p0"], ix["p1"]], [ix["p2"], ix["own"]]])
    with_own = obj.grid_cost(grid, np.array([ix["p3"]]))
    grid[1, 1] = ix["p3"]
    without = obj.grid_cost(grid, np.array([ix["own"]]))
    assert without.parts["compute_per_micro_batch"] == pytest.approx(
        2 / 1.5 * with_own.parts["compute_per_micro_batch"]
    )
    assert "own" in plan(sc, "peerd", generations=2, time_budget=30).allocation.devices


def test_clipping_adds_the_norms_trip_up_the_pipeline_and_back() -> None:
    """With ``norm_exchange`` a step ends with one small message per boundary each way, at the
    boundary's slowest matched pair; one stage has no trip."""
    sc = random_cluster(8, np.random.default_rng(5), d_pp=4)
    sc = dataclasses.replace(sc, training=dataclasses.replace(sc.training, global_batch=8))
    clipped = dataclasses.replace(sc, training=dataclasses.replace(sc.training, norm_exchange=True))
    grid = np.arange(8).reshape(4, 2)
    plain, with_norm = (PeerdObjective(Problem(x), Shape(4, 2)) for x in (sc, clipped))
    base, cost = plain.grid_cost(grid, NONE), with_norm.grid_cost(grid, NONE)
    assert base.parts["norm"] == 0.0 and cost.parts["norm"] > 0
    assert cost.total == pytest.approx(base.total + cost.parts["norm"])
    # an allocation as written pairs replica j's devices: the trip is over those pairs
    ids = with_norm.problem.ids
    alloc = Allocation(tuple(tuple(ids[d] for d in row) for row in grid))
    delay = with_norm.problem.delay
    hop = [
        max((delay[a, b] + delay[b, a]) / 2 for a, b in zip(grid[k], grid[k + 1], strict=True))
        for k in range(3)
    ]
    assert score_allocation(with_norm, alloc).parts["norm"] == pytest.approx(2 * sum(hop))
    one = PeerdObjective(Problem(clipped), Shape(1, 8)).grid_cost(np.arange(8).reshape(1, 8), NONE)
    assert one.parts["norm"] == 0.0


def test_a_members_exchanges_run_at_once_each_on_its_link_or_on_a_declared_access_link() -> None:
    """d_pp = 1 over four devices: each member sends its three shares at once and gets the averages
    back the same way, each flow on its own link; a device whose access link the scenario declares
    carries all three on it, when that takes longer."""
    fast, slow = 800.0, 100.0  # Mbit/s
    lan = 1e4  # a region's own (unused: one device per region)
    bw = [[lan, fast, slow, slow], [fast, lan, slow, slow], [slow, slow, lan, slow], [slow, slow, slow, lan]]
    delay = [[0.0 if i == j else 1.0 + i + j for j in range(4)] for i in range(4)]  # ms
    access = [None, 900.0, 150.0, None]  # d1's access link is faster than its three shares need
    devices = [
        Device(id=f"d{i}", region=f"r{i}", tflops=1e6, memory_gb=1e3, access_mbps=access[i]) for i in range(4)
    ]
    sc = Scenario(
        name="uplinks",
        regions=Regions(names=[f"r{i}" for i in range(4)], delay_ms=delay, bandwidth_mbps=bw),
        devices=devices,
        model=ModelShape(layers=2, hidden=64, seq=16),
        training=TrainingSpec(global_batch=4, micro_batch=1, d_pp=1, d_dp=4, c_dp_bytes=4e6),
    )
    cost = PeerdObjective(Problem(sc), Shape(1, 4)).grid_cost(np.arange(4).reshape(1, 4), NONE)
    share_bits = 8 * 4e6 / 4  # the one stage exchanges c_dp_bytes, a quarter to each member
    member = []
    for i in range(4):
        others = [j for j in range(4) if j != i]
        slowest = max(share_bits / (bw[i][j] * 1e6) for j in others)
        shared = 3 * share_bits / (access[i] * 1e6) if access[i] else 0.0
        member.append(2 * (max(delay[i][j] for j in others) / 1e3 + max(slowest, shared)))
    assert cost.parts["dp"] == pytest.approx(max(member))
    # d0 and d1: their slowest partner's link paces them; d2's access link carries its three shares
    assert member[0] == pytest.approx(2 * (4 / 1e3 + share_bits / 100e6))
    assert member[1] == pytest.approx(2 * (5 / 1e3 + share_bits / 100e6))
    assert member[2] == pytest.approx(2 * (6 / 1e3 + 3 * share_bits / 150e6))


def test_a_layers_work_beside_its_flops_costs_each_device_what_it_measured() -> None:
    """``model.layer_work`` adds, per layer and micro-batch, ops x the device's seconds per op,
    traffic / its memory bandwidth and element units x its seconds per unit (the mean layer's, as the
    FLOPs); a device that measured none of them is priced by its FLOPs alone."""
    from peerd.sched.elements import PerFamily
    from peerd.sched.scenario import LayerWork

    work = [
        LayerWork(ops=10, traffic_bytes=1e6, elements=PerFamily(gelu=1000)),
        LayerWork(ops=30, traffic_bytes=3e6, elements=PerFamily(gelu=3000, attention=4)),
    ]
    measured = dict(
        launch_us=5.0, memory_bandwidth_gb_s=10.0, element_ns=PerFamily(gelu=2.0, attention=500.0)
    )
    devices = [
        Device(id="bare", region="r", tflops=0.1, memory_gb=8.0),
        Device(id="measured", region="r", tflops=0.1, memory_gb=8.0, **measured),  # type: ignore[arg-type]
    ]
    model = ModelShape(layers=2, hidden=64, seq=32, layer_params=[1e5, 1e5])
    sc = Scenario(
        name="work",
        devices=devices,
        regions=Regions(names=["r"], delay_ms=[[0.0]], bandwidth_mbps=[[1000.0]]),
        model=model,
        training=TrainingSpec(global_batch=2, micro_batch=2, d_pp=1, d_dp=1),
    )
    flops_only = PeerdObjective(Problem(sc), Shape(1, 1))
    priced = PeerdObjective(
        Problem(dataclasses.replace(sc, model=dataclasses.replace(model, layer_work=work))), Shape(1, 1)
    )
    flops_s = flops_only.layer_flops / 0.1e12
    extra = 20 * 5e-6 + 2e6 / 10e9 + (2000 * 2.0 + 2 * 500.0) * 1e-9  # the mean layer's work
    ix = priced.problem.index
    assert priced.speed[ix["bare"]] == pytest.approx(0.1)
    assert priced.speed[ix["measured"]] == pytest.approx(priced.layer_flops / (flops_s + extra) / 1e12)
    cost = priced.grid_cost(np.array([[ix["measured"]]]), np.array([ix["bare"]]))
    assert cost.parts["compute_per_micro_batch"] == pytest.approx(2 * (flops_s + extra))
    # the bare device is faster on paper, so the plan takes it
    assert score_allocation(priced, Allocation((("bare",),))).total < cost.total
    assert cost.parts["update"] == 0.0  # no optimizer step was counted
    # the search's seeds take the faster device as the model sees it, not by its FLOPs alone
    from peerd.sched.seeding import active_devices

    assert active_devices(priced, 1).tolist() == [ix["bare"]]
    slower_on_paper = dataclasses.replace(devices[0], tflops=0.0999)  # without the counted work,
    worse = dataclasses.replace(sc, devices=[slower_on_paper, devices[1]])  # the FLOPs alone decide
    assert active_devices(PeerdObjective(Problem(worse), Shape(1, 1)), 1).tolist() == [ix["measured"]]


def _two_core_box(launch_us: list[float], memory_bandwidth_gb_s: list[float]) -> list[Device]:
    """One-thread CPU devices in one region on one 2-core machine, with these measured costs."""
    box = HostShare("box", cores=2, threads=1)
    return [
        Device(
            id=f"d{i}",
            region="r",
            tflops=0.1,
            memory_gb=8.0,
            launch_us=us,
            memory_bandwidth_gb_s=gb_s,
            host=box,
        )
        for i, (us, gb_s) in enumerate(zip(launch_us, memory_bandwidth_gb_s, strict=True))
    ]


def test_each_stage_steps_its_optimizer_over_its_own_layers_after_the_exchange() -> None:
    """The update of a stage is its layers' counted update ops and bytes at its slowest member's
    measured costs (slowed on a shared machine like its compute); the slowest stage's adds to the total."""
    from peerd.sched.scenario import LayerWork

    work = [
        LayerWork(update_ops=40, update_traffic_bytes=8e6),
        *[LayerWork(update_ops=20, update_traffic_bytes=1e6)] * 3,
    ]
    devices = _two_core_box(launch_us=[4.0] * 4, memory_bandwidth_gb_s=[20.0] * 4)
    sc = Scenario(
        name="update",
        devices=devices,
        regions=Regions(names=["r"], delay_ms=[[0.0]], bandwidth_mbps=[[1000.0]]),
        model=ModelShape(layers=4, hidden=64, seq=32, layer_work=work),
        training=TrainingSpec(global_batch=4, micro_batch=2, d_pp=2, d_dp=2),
    )
    obj = PeerdObjective(Problem(sc), Shape(2, 2))
    cost = obj.grid_cost(np.arange(4).reshape(2, 2), NONE)
    first = (40 + 20) * 4e-6 + 9e6 / 20e9  # an even split: the embedding-heavy layer and one more
    assert cost.parts["update"] == pytest.approx(2 * first)  # four tasklets on two cores: half speed
    assert cost.total == pytest.approx(cost.parts["pp"] + cost.parts["dp"] + cost.parts["update"])


def test_each_member_averages_at_its_stages_slowest_member_beside_the_links() -> None:
    """A stage's exchange adds its members' averaging arithmetic: the counted ops and the bytes per
    gradient value of a group of its width, at the slowest member's measured costs, slowed on a
    shared machine like its compute."""
    from peerd.sched.scenario import AveragingWork

    work = AveragingWork(ops=10, ops_per_partner=5, bytes_per_value=20, bytes_per_value_partners=8)
    devices = _two_core_box(launch_us=[4.0, 2.0, 2.0, 2.0], memory_bandwidth_gb_s=[20.0, 40.0, 40.0, 10.0])
    model = ModelShape(layers=4, hidden=64, seq=32, params=4e6)

    def dp(averaging_work: AveragingWork | None) -> float:
        sc = Scenario(
            name="averaging",
            devices=devices,
            regions=Regions(names=["r"], delay_ms=[[0.0]], bandwidth_mbps=[[1000.0]]),
            model=model,
            training=TrainingSpec(
                global_batch=4, micro_batch=1, d_pp=1, d_dp=4, averaging_work=averaging_work
            ),
        )
        obj = PeerdObjective(Problem(sc), Shape(1, 4))
        return obj.grid_cost(np.arange(4).reshape(1, 4), NONE).parts["dp"]

    assert work.at(1) == (0.0, 0.0) and work.at(4) == (25.0, 26.0)
    # four tasklets on two cores: twice the slowest member's seconds per op (4 us) and per byte (1/10 GB/s)
    expected = 2 * (25 * 4e-6 + 4e6 * 26 / 10e9)
    assert dp(work) - dp(None) == pytest.approx(expected)


def test_layer_work_must_list_every_layer() -> None:
    with pytest.raises(ConfigError, match="layer_work"):
        Scenario.from_mapping(
            {
                "devices": [{"id": "a", "tflops": 1, "memory_gb": 1}],
                "model": {"layers": 2, "hidden": 8, "seq": 8, "layer_work": [{"ops": 3}]},
            }
        )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_full_pipeline_is_paced_by_a_boundarys_busier_direction_not_its_round_trip(schedule) -> None:
    """Two stages, free compute, four micro-batches: one goes there and back (both delays, both
    directions' serialisation); each of the others costs its busier direction's serialisation, as
    activations and gradients cross at once on two links and a delay overlaps the next message.
    1F1B holds at most two micro-batches at stage 0, so there a round trip comes back every two."""
    delay_ms, mbit = 20.0, 100.0
    sc = Scenario(
        name="two-stages",
        regions=Regions(
            names=["r0", "r1"],
            delay_ms=[[0.0, delay_ms], [delay_ms, 0.0]],
            bandwidth_mbps=[[1e4, mbit], [mbit, 1e4]],
        ),
        devices=[Device(id=f"d{i}", region=f"r{i}", tflops=1e9, memory_gb=1e3) for i in range(2)],
        model=ModelShape(layers=2, hidden=64, seq=16),
        training=TrainingSpec(
            global_batch=4,
            micro_batch=1,
            d_pp=2,
            d_dp=1,
            c_pp_bytes=4e6,
            backward_ratio=0.5,
            schedule=schedule,
        ),
    )
    cost = PeerdObjective(Problem(sc), Shape(2, 1)).grid_cost(np.arange(2).reshape(2, 1), NONE)
    forward, backward = 8 * 1e6 / (mbit * 1e6), 0.5 * 8 * 1e6 / (mbit * 1e6)  # one micro-batch's bytes
    there_and_back = 2 * delay_ms / 1e3 + forward + backward
    pace = forward if schedule == "gpipe" else max(forward, there_and_back / 2)
    assert cost.parts["pp"] == pytest.approx(there_and_back + 3 * pace, rel=1e-6)


def _busy_box(idle_cores: float | None, hosts: list[str]) -> Scenario:
    """Four peers with measured messaging costs on fast links: 2 stages x 2 replicas, 4 micro-batches
    of 1e6 activation bytes, 2e6 gradient bytes per stage."""
    devices = [
        Device(
            id=f"d{i}",
            region="r",
            tflops=0.5,
            memory_gb=8.0,
            host=HostShare(host, cores=2, threads=1),
            message_us=500.0,
            wire_byte_ns=2.0,
            idle_cores=idle_cores,
        )
        for i, host in enumerate(hosts)
    ]
    return Scenario(
        name="busy-box",
        devices=devices,
        regions=Regions(names=["r"], delay_ms=[[0.0]], bandwidth_mbps=[[1e5]]),
        model=ModelShape(layers=4, hidden=64, seq=32),
        training=TrainingSpec(global_batch=8, micro_batch=1, d_pp=2, d_dp=2, c_pp_bytes=4e6, c_dp_bytes=2e6),
    )


def test_a_machines_cores_bound_the_iteration_by_its_daemons_work_and_messages() -> None:
    """A shared machine runs its tasklets' compute and their messages on its cores less what its
    daemons keep busy idle: the iteration takes at least that CPU time over those cores."""
    obj = PeerdObjective(Problem(_busy_box(0.25, ["box"] * 4)), Shape(2, 2))
    cost = obj.grid_cost(np.arange(4).reshape(2, 2), NONE)
    compute = 4 * (4 * 2 * obj.layer_flops / 0.5e12)  # four members: 4 micro-batches x 2 layers each
    # each member: per micro-batch an activation and a gradient (1e6 B each) at its one boundary,
    # both sent or received; per iteration 2 x 1 share of 1e6 B out and as many in
    ends, payload = 4 * (4 * 2 + 4), 4 * (4 * 2e6 + 4 * 1e6)
    cpu = compute + ends * 500e-6 + payload * 2e-9
    assert cost.parts["host_cpu"] == pytest.approx(cpu / (2 - 4 * 0.25))
    phases = cost.parts["pp"] + cost.parts["dp"] + cost.parts["update"] + cost.parts["norm"]
    assert phases < cost.parts["host_cpu"] == pytest.approx(cost.total)  # the floor binds here

    # without the daemons' idle load there are twice the cores
    bare = PeerdObjective(Problem(_busy_box(None, ["box"] * 4)), Shape(2, 2))
    assert bare.grid_cost(np.arange(4).reshape(2, 2), NONE).parts["host_cpu"] == pytest.approx(cpu / 2)
    # on two machines, each carries its own two members: the busier bounds the iteration
    apart = PeerdObjective(Problem(_busy_box(0.25, ["x", "y", "x", "y"])), Shape(2, 2))
    split = apart.grid_cost(np.arange(4).reshape(2, 2), NONE)
    assert split.parts["host_cpu"] == pytest.approx(cpu / 2 / (2 - 2 * 0.25))
    # clipping's norm trip: a partial sum up and the total down each boundary, two more ends a member
    sc = _busy_box(0.25, ["box"] * 4)
    clipped = dataclasses.replace(sc, training=dataclasses.replace(sc.training, norm_exchange=True))
    trip = PeerdObjective(Problem(clipped), Shape(2, 2)).grid_cost(np.arange(4).reshape(2, 2), NONE)
    assert trip.parts["host_cpu"] == pytest.approx((cpu + 4 * 2 * 500e-6) / (2 - 4 * 0.25))


def test_compressing_codec_calls_count_on_the_machines_cores() -> None:
    """Per micro-batch and boundary a member makes one codec call per direction that compresses (it
    encodes what it sends, decodes what it gets); uncompressed directions call none."""
    grid = np.arange(4).reshape(2, 2)

    def host(forward: float, backward: float, priced: bool) -> float:
        sc = _busy_box(0.25, ["box"] * 4)
        sc = dataclasses.replace(
            sc, training=dataclasses.replace(sc.training, forward_ratio=forward, backward_ratio=backward)
        )
        if priced:
            sc = dataclasses.replace(
                sc, devices=[dataclasses.replace(d, codec_us=800.0, codec_value_ns=3.0) for d in sc.devices]
            )
        return PeerdObjective(Problem(sc), Shape(2, 2)).grid_cost(grid, NONE).parts["host_cpu"]

    call = 800e-6 + 1 * 32 * 64 * 3e-9  # one micro-batch: 1 sequence x 32 tokens x 64 wide
    spare = 2 - 4 * 0.25
    assert host(1.0, 1.0, priced=True) == pytest.approx(host(1.0, 1.0, priced=False))  # nothing compresses
    for forward, backward, directions in ((0.125, 1.0, 1), (0.125, 0.25, 2)):
        extra = host(forward, backward, priced=True) - host(forward, backward, priced=False)
        # four members x 4 micro-batches x their one boundary x the compressing directions
        assert extra == pytest.approx(4 * 4 * directions * call / spare)


def test_a_hop_waits_for_its_ends_message_and_codec_cpu() -> None:
    """Per micro-batch there and back, a boundary's hop waits for a message end each side each way
    and, per compressing direction, an encode and a decode: slowed with the compute where the
    layout oversubscribes the machine; the norm's trip and the all-reduce wait for their messages'
    ends too."""
    grid = np.arange(4).reshape(2, 2)
    call = 800e-6 + 1 * 32 * 64 * 3e-9  # one micro-batch: 1 sequence x 32 tokens x 64 wide

    def cost(hosts: list[str], message_us: float | None) -> Cost:
        sc = _busy_box(None, hosts)
        sc = dataclasses.replace(
            sc,
            devices=[
                dataclasses.replace(d, message_us=message_us, codec_us=800.0, codec_value_ns=3.0)
                for d in sc.devices
            ],
            training=dataclasses.replace(sc.training, forward_ratio=0.125, norm_exchange=True),
        )
        return PeerdObjective(Problem(sc), Shape(2, 2)).grid_cost(grid, NONE)

    alone = cost(["a", "b", "c", "d"], 500.0)  # a machine each: nothing slows
    # an activation (1e6 B x 1/8) and a gradient (1e6 B) through both ends at 2 ns a byte; the
    # forward compresses: one encode, one decode
    payload = 1e6 * (0.125 + 1.0) * (2e-9 + 2e-9)
    hop = 2 * (500e-6 + 500e-6) + payload + 1 * (call + call)
    assert alone.parts["hop_cpu_per_micro_batch"] == pytest.approx(hop)
    free = cost(["a", "b", "c", "d"], None)
    assert free.parts["hop_cpu_per_micro_batch"] == pytest.approx(payload + 2 * call)
    assert alone.parts["norm"] - free.parts["norm"] == pytest.approx(2 * (500e-6 + 500e-6))
    assert alone.parts["pp"] > free.parts["pp"]
    # the all-reduce waits for its member's message ends too: 1 share out and in, then 1 average
    assert alone.parts["dp"] - free.parts["dp"] == pytest.approx(4 * 500e-6)
    # four single-thread tasklets on one 2-core machine: every end and call takes twice as long
    shared = cost(["box"] * 4, 500.0)
    assert shared.parts["hop_cpu_per_micro_batch"] == pytest.approx(2 * hop)


def test_no_declared_machine_means_no_floor() -> None:
    sc = _busy_box(None, ["box"] * 4)
    sc = dataclasses.replace(
        sc,
        devices=[dataclasses.replace(d, host=None, message_us=None, wire_byte_ns=None) for d in sc.devices],
    )
    cost = PeerdObjective(Problem(sc), Shape(2, 2)).grid_cost(np.arange(4).reshape(2, 2), NONE)
    assert cost.parts["host_cpu"] == 0.0
    assert cost.total == pytest.approx(cost.parts["pp"] + cost.parts["dp"] + cost.parts["update"])
