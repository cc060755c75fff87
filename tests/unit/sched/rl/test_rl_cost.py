"""Each cost and memory term of the RL scheduler on small hand-computed cases."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from peerd.errors import ConfigError
from peerd.sched.elements import PerFamily
from peerd.sched.rl import cost, exact, memory
from peerd.sched.rl.baselines import verl_like, verl_like_choice
from peerd.sched.rl.cluster import Cluster, rl_scenario
from peerd.sched.rl.evaluate import Evaluator
from peerd.sched.rl.group import evaluate_group, shard_groups
from peerd.sched.rl.layout import Layout, arrange, layouts
from peerd.sched.rl.workload import CostConstants, Launches, ModelSize, Workload
from peerd.sched.scenario import Device, Regions, Scenario

# one layer, one head of 64: a token's KV is 2 (K, V) x 1 x 1 x 64 x 2 bytes = 256 bytes
TOY = ModelSize(params=1e9, layers=1, hidden=64, heads=1, vocab=100)
HALF = CostConstants(compute_efficiency=0.5, memory_efficiency=0.5, memory_usable=1.0)


def toy_workload(**kw) -> Workload:
    args = dict(
        actor=TOY, prompts=25, responses_per_prompt=1, prompt_len=100, response_len=100, micro_batch=1
    )
    args.update(kw)
    return Workload(constants=HALF, **args)  # type: ignore[arg-type]


def test_ring_allreduce():
    # 2 (n-1)/n x bytes / bw + 2 (n-1) x delay = 1.5 s + 6 ms
    assert cost.allreduce(1e9, 4, 1e-3, 1e9) == pytest.approx(1.506)
    assert cost.allreduce(1e9, 1, 1.0, 1.0) == 0.0


def test_tensor_parallel_traffic():
    # 2 all-reduces x 3 layers x ring(10 tokens x 64 x 2 bytes = 1280 B over 2 ranks: 1280/1e6 + 2e-3)
    assert cost.tp_traffic(10, 3, 2, 64, 2.0, 2, 1e-3, 1e6) == pytest.approx(6 * (1280 / 1e6 + 2e-3))
    assert cost.tp_traffic(10, 3, 2, 64, 2.0, 1, 1e-3, 1e6) == 0.0


def test_generation_roofline_with_waves():
    w = toy_workload()
    assert TOY.kv_bytes_per_token(2.0) == 256.0
    # room for exactly 10 sequences of 200 tokens: 25 sequences take 3 waves of 25/3
    rep = cost.ReplicaGen(flops=1e12, mem_bw=1e11, free=256 * 200 * 10, alpha=0.0, beta=math.inf)
    c = 25 / 3
    prefill = 2 * 1e9 * c * 100 / 5e11  # 2 P c T_p / (F e_c)
    read = (2e9 + c * 256 * (100 + 50)) / 5e10  # weights + average KV per step / (B e_m)
    compute = 2e9 * c / 5e11  # below the memory time: decode is memory-bound here
    assert compute < read
    # the prefill's logits sample the first token: T_r - 1 = 99 decode steps
    assert cost.generation_time(TOY, w, rep, 1, 25) == pytest.approx(3 * (prefill + 99 * read))
    short = cost.ReplicaGen(flops=1e12, mem_bw=1e11, free=256 * 199, alpha=0.0, beta=math.inf)
    assert cost.generation_time(TOY, w, short, 1, 25) == math.inf  # not one sequence's KV fits


def two_stages(stage_launch: np.ndarray | None = None) -> cost.Pipelines:
    """One replica of two stages (1 and 0.5 TFLOP/s, no tensor parallelism), 10 ms / 1 MB/s apart."""
    return cost.Pipelines(
        stage_flops=np.array([[1e12, 5e11]]),
        stage_alpha=np.zeros((1, 2)),
        stage_beta=np.full((1, 2), np.inf),
        hop_alpha=np.array([[[0.01]]]),
        hop_beta=np.array([[[1e6]]]),
        stage_launch=stage_launch,
    )


def test_pipeline_slot_and_time():
    w = toy_workload()
    pipes = two_stages()
    # forward of a micro-batch (199 positions: every token but the last) on half the params:
    # 2 x 5e8 x 199 / (F x 0.5) = 0.398 s, 0.796 s; boundary: 0.01 + 199 x 64 x 2 / 1e6 = 0.0355 s,
    # below the slower stage
    assert cost.pipeline_slots(TOY, w, pipes, 1, train=False)[0] == pytest.approx(0.796)
    # training with recomputation: 4 forwards = 3.184 s on the slow stage (transfers 2 x 0.0355)
    assert cost.pipeline_slots(TOY, w, pipes, 1, train=True)[0] == pytest.approx(3.184)
    assert cost.pipeline_time(4, 2, 0.8) == pytest.approx(5 * 0.8)  # 4 micro-batches + 1 slot of bubble
    slow_link = cost.Pipelines(
        pipes.stage_flops, pipes.stage_alpha, pipes.stage_beta, np.array([[[0.01]]]), np.array([[[1e4]]])
    )
    # 25472 bytes at 1e4 B/s = 2.5472 s + 0.01: the link is the slot now
    assert cost.pipeline_slots(TOY, w, slow_link, 1, train=False)[0] == pytest.approx(2.5572)


def test_balanced_split_follows_rates():
    times = {0: 1.0, 1: 3.0}  # seconds per sequence
    split = cost.balanced_split(8.0, 2, lambda r, s: times[r] * s, balanced=True)
    assert split == pytest.approx([6.0, 2.0])  # rates 1 : 1/3
    assert cost.balanced_split(8.0, 2, lambda r, s: times[r] * s, balanced=False) == [4.0, 4.0]


def test_best_pair_transfer_and_broadcast_tree():
    alpha = np.array([[0.01, 0.05]])
    beta = np.array([[1e6, 1e8]])
    # 1e6 bytes: 0.01 + 1 = 1.01 vs 0.05 + 0.01 = 0.06
    assert cost.transfer_time(1e6, alpha, beta) == pytest.approx(0.06)
    cl = _cluster([(0, 1, 100.0), (1, 2, 10.0), (0, 2, 1.0)])
    # widest spanning tree: 0-1 (100) and 1-2 (10); its narrowest edge is 10 Mbit/s = 1.25e6 B/s
    assert cost.tree_bottleneck(cl, [0, 1, 2]) == pytest.approx(10e6 / 8)
    # relay of 1.25e6 bytes: 1 s over the narrowest edge + the largest delay (5 ms)
    assert cost.sync_internal(cl, [0, 1, 2], 1.25e6) == pytest.approx(1.005)
    assert cost.sync_internal(cl, [0], 1.25e6) == 0.0


def test_memory_terms():
    w = toy_workload(prompts=8)
    k = w.constants
    lay = Layout(dp=2, pp=2, tp=1)
    # inference: 1e9 x 2 / 2 weights + 34 x 200 x 64 working set; logits 200 x 100 x 4 on the last stage
    inf = memory.inference_stage_bytes(TOY, w, lay)
    assert inf[0] == pytest.approx(1e9 + 34 * 200 * 64)
    assert inf[1] - inf[0] == pytest.approx(200 * 100 * 4)
    # training, 4 micro-batches per replica; in flight 2 at stage 0, 1 at stage 1 (1F1B)
    tr = memory.training_stage_bytes(TOY, w, lay, optimizer_local=True)
    state = 1e9 * (2 + 2) / 2 + 1e9 * 12 / 4
    ckpt = 200 * 0.5 * 64 * 2  # one checkpoint per layer: half a layer per stage here
    work = 34 * 200 * 64
    assert tr[0] == pytest.approx(state + 2 * ckpt + work)
    assert tr[1] == pytest.approx(state + ckpt + work + 2 * 200 * 100 * 4)
    # a group of two tasks parks both models' weights and the trained one's optimizer state
    assert memory.parked_total(w, ("generate", "actor_train")) == pytest.approx(1e9 * (k.weight_bytes + 12))
    assert memory.parked_total(w, ("actor_train",)) == 0.0
    assert memory.parked_per_device(30.0, np.array([1.0, 2.0])) == pytest.approx([10.0, 20.0])


def test_layouts_and_arrangement():
    found = {(x.dp, x.pp, x.tp, x.stage_major) for x in layouts(4, layers=8, heads=4, generation=False)}
    assert found == {(4, 1, 1, False), (2, 2, 1, False), (2, 2, 1, True), (1, 4, 1, False),
                     (2, 1, 2, False), (1, 2, 2, False), (1, 1, 4, False)}  # fmt: skip
    assert all(x.pp == 1 for x in layouts(8, layers=8, heads=8, generation=True))
    grid = arrange([10, 11, 12, 13], Layout(2, 2, 1))
    assert grid[:, :, 0].tolist() == [[10, 11], [12, 13]]  # replica-major: a pipeline is a block
    grid = arrange([10, 11, 12, 13], Layout(2, 2, 1, stage_major=True))
    assert grid[:, :, 0].tolist() == [[10, 12], [11, 13]]  # stage-major: a stage's replicas are a block


def test_training_task_time_adds_data_parallel_allreduce():
    cl = _cluster([(0, 1, 8.0)], tflops=1.0)  # 8 Mbit/s = 1e6 B/s, 5 ms
    w = toy_workload(prompts=4, optimizer_steps=2)
    r = evaluate_group(cl, w, ("actor_train",), [0, 1], only={"actor_train": Layout(2, 1, 1)})
    slot = 8 * 1e9 * 199 / (1e12 * 0.5)  # 3.184 s per micro-batch
    micro = 1  # 4 sequences / 2 replicas / 2 steps
    ar = cost.allreduce(1e9 * 2, 2, 0.005, 1e6)  # bf16 gradients of the whole model
    assert r.plans["actor_train"].seconds == pytest.approx(2 * (micro * slot + ar))


def test_ring_allgather_is_half_an_allreduce():
    # (n-1)/n x bytes / bw + (n-1) x delay = 0.75 s + 3 ms
    assert cost.allgather(1e9, 4, 1e-3, 1e9) == pytest.approx(0.753)
    assert 2 * cost.allgather(1e9, 4, 1e-3, 1e9) == pytest.approx(cost.allreduce(1e9, 4, 1e-3, 1e9))
    assert cost.allgather(1e9, 1, 1.0, 1.0) == 0.0


def test_fsdp_collectives_per_micro_batch():
    w = toy_workload()
    gather = 0.75 * 1e9 * 2 / 1e9 + 3e-3  # bf16 weights of 1e9 params over 4 devices
    scatter = 0.75 * 1e9 * 4 / 1e9 + 3e-3  # fp32 gradients (verl's default reduce dtype)
    assert cost.fsdp_collectives(TOY, w, 4, 1e-3, 1e9, train=False) == pytest.approx(gather)
    assert cost.fsdp_collectives(TOY, w, 4, 1e-3, 1e9, train=True) == pytest.approx(2 * gather + scatter)


def test_fsdp_memory_holds_gathered_layers_not_a_replica():
    w = toy_workload(prompts=8)
    tokens, gathered = 200, 2 * 1e9 * 2 / 1  # two gathered layers (the toy has one layer of 1e9 params)
    work, logits = 34 * tokens * 64, tokens * 100 * 4
    assert memory.fsdp_bytes(TOY, w, 2, train=False) == pytest.approx(gathered + work + logits)
    ckpt, grads = tokens * 1 * 64 * 2, 1e9 * 2 / 2
    assert memory.fsdp_bytes(TOY, w, 2, train=True) == pytest.approx(
        gathered + grads + ckpt + work + 2 * logits
    )


def test_fsdp_tasks_gather_per_micro_batch_and_reshard_for_generation():
    cl = _cluster([(0, 1, 8.0)], tflops=1.0)  # d0-d1: 8 Mbit/s = 1e6 B/s, 5 ms; d0-d2: 1 Tbit/s
    w = toy_workload(prompts=4, optimizer_steps=2)
    sharded = Layout(2, 1, 1, fsdp=True)
    compute = 8 * 1e9 * 199 / (1e12 * 0.5)  # 3.184 s per micro-batch; 1 per device per step
    gather = 0.5 * 2e9 / 1e6 + 0.005  # 1000.005 s: the slow link sets the ring
    train = 2 * gather + (0.5 * 4e9 / 1e6 + 0.005)
    r = evaluate_group(cl, w, ("actor_train",), [0, 1], only={"actor_train": sharded})
    assert r.plans["actor_train"].seconds == pytest.approx(2 * 1 * max(compute, train))
    r = evaluate_group(cl, w, ("reference",), [0, 1], only={"reference": sharded})
    assert r.plans["reference"].seconds == pytest.approx(2 * max(0.8, gather))  # 2 micro-batches, no steps
    both = {"generate": Layout(2, 1, 1), "actor_train": sharded}
    r = evaluate_group(cl, w, ("generate", "actor_train"), [0, 1], only=both)
    assert r.plans["actor_train"].seconds == pytest.approx(2 * max(compute, train) + gather)  # + reshard
    fast = 0.5 * 2e9 / 1.25e11 + 0.005
    r = evaluate_group(cl, w, ("actor_train",), [0, 2], only={"actor_train": sharded})
    assert 2 * fast + 0.5 * 4e9 / 1.25e11 + 0.005 < compute  # fast links: the gathers hide behind compute
    assert r.plans["actor_train"].seconds == pytest.approx(2 * compute)


def test_verl_like_trains_and_infers_under_fsdp():
    cl = _cluster([(0, 1, 8.0)], tflops=1.0)
    w = toy_workload(prompts=6)
    grouping, _, score = verl_like(cl, w)
    choice = verl_like_choice(cl, w)
    assert choice.score == score and choice.fsdp_size in (1, 3)  # the divisors of 3 devices
    sharded = Layout(3, 1, 1, fsdp=True)
    full = {"generate": Layout(3, 1, 1), "reference": sharded, "actor_train": sharded}
    r = evaluate_group(cl, w, grouping[0], [0, 1, 2], balanced=False, only=full)
    assert score.seconds <= r.busy  # FULL_SHARD at the workload's micro-batch is one candidate
    chosen = {
        "generate": Layout(3 // choice.rollout_tp, 1, choice.rollout_tp),
        **{
            t: Layout(3, 1, 1, fsdp=True, fsdp_size=choice.fsdp_size, micro_batch=m)
            for t, m in choice.micro_batch.items()
        },
    }
    r = evaluate_group(cl, w, grouping[0], [0, 1, 2], balanced=False, only=chosen)
    assert score.seconds == pytest.approx(r.busy)  # one group: its tasks run one after another


def test_hsdp_shards_inside_groups_and_all_reduces_across_them():
    cl = _two_regions()  # d0 d1 in r0, d2 d3 in r1: 1 Tbit/s inside a region, 8 Mbit/s and 5 ms across
    w = toy_workload(prompts=4)
    compute = 8 * 1e9 * 199 / (1e12 * 0.5)  # 3.184 s per micro-batch of 1 sequence; 1 per device
    gather = 0.5 * 2e9 / 1.25e11  # inside a region's shard group {d0, d1} or {d2, d3}: 8 ms
    scatter = 0.5 * 4e9 / 1.25e11  # fp32 gradients: 16 ms
    allreduce = 2 * 0.5 * (1e9 * 4 / 2) / 1e6 + 2 * 0.005  # fp32 shard of 1/2 over {d0, d2}: 2000.01 s
    hsdp = Layout(4, 1, 1, fsdp=True, fsdp_size=2)
    r = evaluate_group(cl, w, ("actor_train",), [0, 1, 2, 3], only={"actor_train": hsdp})
    assert r.plans["actor_train"].seconds == pytest.approx(max(compute, 2 * gather + scatter + allreduce))
    r = evaluate_group(cl, w, ("reference",), [0, 1, 2, 3], only={"reference": hsdp})
    assert r.plans["reference"].seconds == pytest.approx(max(0.796, gather))  # no all-reduce in inference
    full = Layout(4, 1, 1, fsdp=True)  # FULL_SHARD: every gather crosses the slow link
    ring = 0.75 * 2e9 / 1e6 + 3 * 0.005
    r = evaluate_group(cl, w, ("actor_train",), [0, 1, 2, 3], only={"actor_train": full})
    assert r.plans["actor_train"].seconds == pytest.approx(2 * ring + 0.75 * 4e9 / 1e6 + 3 * 0.005)
    # colocated with generation: the parked state is sharded over 2 devices, not 4, and the
    # reshard gathers inside the shard group
    both = {"generate": Layout(4, 1, 1), "actor_train": hsdp}
    r = evaluate_group(cl, w, ("generate", "actor_train"), [0, 1, 2, 3], only=both)
    assert r.plans["actor_train"].seconds == pytest.approx(
        max(compute, 2 * gather + scatter + allreduce) + gather
    )
    parked = 1e9 * (2 + 12) / 2  # actor weights + optimizer state over the shard group
    assert r.plans["actor_train"].peak[0] == pytest.approx(parked + memory.fsdp_bytes(TOY, w, 2, True))


def test_hsdp_groups_follow_device_order_not_links():
    assert shard_groups([3, 0, 2, 1], 2).tolist() == [[0, 1], [2, 3]]
    assert shard_groups(np.array([[2], [0], [1], [3]]), 4).tolist() == [[0, 1, 2, 3]]
    mixed = _two_regions(order=("r0", "r1", "r0", "r1"))  # consecutive ranks now straddle the link
    w = toy_workload(prompts=4)
    hsdp = Layout(4, 1, 1, fsdp=True, fsdp_size=2)
    r = evaluate_group(mixed, w, ("reference",), [0, 1, 2, 3], only={"reference": hsdp})
    assert r.plans["reference"].seconds == pytest.approx(0.5 * 2e9 / 1e6 + 0.005)  # not regrouped by region


def test_verl_like_takes_the_best_fsdp_size_and_micro_batch():
    cl = _two_regions()
    w = toy_workload(prompts=8)  # 2 sequences per device: micro-batches of 1 or 2
    choice = verl_like_choice(cl, w)
    # sharding inside a region beats FULL_SHARD (gathers over 8 Mbit/s) and plain data parallel
    # (a full fp32 all-reduce over 8 Mbit/s); one micro-batch of 2 halves the all-reduces
    assert (choice.fsdp_size, choice.micro_batch) == (2, {"reference": 2, "actor_train": 2})
    tasks = choice.grouping[0]

    def busy(f: int, m: int) -> float:
        only = {t: Layout(4, 1, 1, fsdp=True, fsdp_size=f, micro_batch=m) for t in tasks if t != "generate"}
        only["generate"] = Layout(4 // choice.rollout_tp, 1, choice.rollout_tp)
        return evaluate_group(cl, w, tasks, [0, 1, 2, 3], balanced=False, only=only).busy

    assert choice.score.seconds == pytest.approx(busy(2, 2))
    assert busy(2, 2) < busy(2, 1) < busy(4, 1) and busy(2, 2) < busy(1, 2) and busy(2, 2) < busy(4, 2)
    d = Layout(4, 1, 1, fsdp=True, fsdp_size=2, micro_batch=2).to_dict()
    assert (d["fsdp_size"], d["micro_batch"]) == (2, 2) and "fsdp" not in Layout(4, 1, 1).to_dict()


OPS = Launches(
    generate=50,
    generate_per_sequence=3,
    decode_step=100,
    inference=400,
    inference_per_micro_batch=60,
    train=10,
    train_per_micro_batch=200,
    optimizer_step=30,
)


def test_generation_pays_its_launches_per_wave():
    w = toy_workload(launches=OPS)
    fast = cost.ReplicaGen(flops=1e12, mem_bw=1e11, free=256 * 200 * 10, alpha=0.0, beta=math.inf)
    slow = cost.ReplicaGen(**{**vars(fast), "launch": 5e-6})
    c = 25 / 3  # three waves, as in the roofline test
    ops = 50 + 3 * c + 100 * 100  # set-up, per sequence, per decode step (T_r = 100)
    extra = cost.generation_time(TOY, w, slow, 1, 25) - cost.generation_time(TOY, w, fast, 1, 25)
    assert extra == pytest.approx(3 * ops * 5e-6)


def test_pipeline_micro_batches_and_steps_pay_their_launches_per_stage():
    w = toy_workload(launches=OPS)
    pipes = two_stages(stage_launch=np.array([[1e-3, 2e-3]]))
    # each stage runs half the layers: half the per-micro-batch ops at its own cost per op
    assert cost.pipeline_slots(TOY, w, pipes, 1, train=False)[0] == pytest.approx(0.796 + 30 * 2e-3)
    assert cost.pipeline_slots(TOY, w, pipes, 1, train=True)[0] == pytest.approx(3.184 + 100 * 2e-3)
    assert cost.task_launches(w, True, 2, 1e-3, 1e9) == pytest.approx((10 * 1e-3, 15 * 1e-3))
    assert cost.task_launches(w, False, 2, 1e-3, 1e9) == pytest.approx((400 * 1e-3, 0.0))


TRAFFIC = Launches(
    generate_bytes_per_sequence=2e6,
    inference_bytes_per_sequence=1e6,
    train_bytes_per_sequence=3e6,
    optimizer_step_bytes=8e6,
)


def test_the_ops_traffic_costs_its_bytes_at_the_devices_memory_bandwidth():
    # micro-batches of 2 sequences; memory at half its rate (HALF's efficiency)
    plain, w = toy_workload(micro_batch=2), toy_workload(micro_batch=2, launches=TRAFFIC)
    pipes = dataclasses.replace(two_stages(), stage_mem_bw=np.array([[8e9, 2e9]]))
    # the slower stage moves half of a micro-batch's bytes at 2 GB/s x 0.5
    for train, per_sequence in ((False, 1e6), (True, 3e6)):
        extra = (
            cost.pipeline_slots(TOY, w, pipes, 1, train)[0]
            - cost.pipeline_slots(TOY, plain, pipes, 1, train)[0]
        )
        assert extra == pytest.approx(2 * per_sequence / 2 / 1e9)
    # an optimizer step: its bytes split over the stages, at the slowest device's memory x 0.5
    assert cost.task_launches(w, True, 2, 0.0, 2e9) == pytest.approx((0.0, 8e6 / 2 / 1e9))
    assert cost.task_launches(w, True, 2, 0.0, 0.0)[1] == math.inf  # no measured memory: no way to move them
    # a generation wave: each of its c sequences' bytes at the replica's memory bandwidth x 0.5
    rep = cost.ReplicaGen(flops=1e12, mem_bw=1e11, free=256 * 200 * 10, alpha=0.0, beta=math.inf)
    extra = cost.generation_time(TOY, w, rep, 1, 25) - cost.generation_time(TOY, plain, rep, 1, 25)
    assert extra == pytest.approx(25 * 2e6 / 5e10)  # three waves of 25/3 sequences


def test_tasks_on_devices_with_a_launch_cost_add_it_and_others_do_not():
    w = toy_workload(prompts=4, optimizer_steps=2, launches=OPS)
    plain = _cluster([], tflops=1.0)
    costly = dataclasses.replace(plain, launch=np.full(3, 1e-3))
    one = {"actor_train": Layout(1, 1, 1), "reference": Layout(1, 1, 1)}
    base = evaluate_group(plain, w, ("reference", "actor_train"), [0], only=one)
    paid = evaluate_group(costly, w, ("reference", "actor_train"), [0], only=one)
    assert base.plans["actor_train"].seconds == pytest.approx(2 * 2 * 3.184)  # 2 steps x 2 micro-batches
    # training: the set-up once, per step its two micro-batches' ops and the optimizer step
    train_ops = 10 + 2 * (2 * 200 + 30)
    assert paid.plans["actor_train"].seconds - base.plans["actor_train"].seconds == pytest.approx(
        train_ops * 1e-3
    )
    # inference: the set-up once and every micro-batch's forward (4 micro-batches of 1)
    assert paid.plans["reference"].seconds - base.plans["reference"].seconds == pytest.approx(
        (400 + 4 * 60) * 1e-3
    )


def test_a_scenario_device_declares_its_launch_cost():
    devs = [Device(id="a", tflops=1.0, memory_gb=100, memory_bandwidth_gb_s=10, launch_us=4.0)]
    cl = Cluster.of(rl_scenario(Scenario(devices=devs), toy_workload()))
    assert cl.launch.tolist() == pytest.approx([4e-6])
    without = Cluster.of(
        rl_scenario(Scenario(devices=[dataclasses.replace(devs[0], launch_us=None)]), toy_workload())
    )
    assert without.launch.tolist() == [0.0]


ELEMENTS = Launches(
    generate_elements=PerFamily(gelu=1000, softmax=500, attention=8),
    inference_elements=PerFamily(gelu=400, softmax=100, attention=4),
    train_elements=PerFamily(gelu=800, softmax=100, attention=4, attention_backward=4),
)
NS = PerFamily(gelu=1.0, softmax=0.5, attention=600.0, attention_backward=900.0)


def test_a_scenario_devices_element_costs_price_each_tasks_units_per_sequence():
    devs = [Device(id="a", tflops=1.0, memory_gb=100, memory_bandwidth_gb_s=10, element_ns=NS)]
    w = toy_workload(launches=ELEMENTS)
    cl = Cluster.of(rl_scenario(Scenario(devices=devs), w))
    per_sequence = [1000 + 250 + 4800, 400 + 50 + 2400, 800 + 50 + 2400 + 3600]  # ns
    assert cl.element_s[0].tolist() == pytest.approx([1e-9 * n for n in per_sequence])
    old = Cluster.of(rl_scenario(Scenario(devices=[dataclasses.replace(devs[0], element_ns=None)]), w))
    assert old.element_s.tolist() == [[0.0, 0.0, 0.0]]  # a device that predates the measurement
    assert cl.cls.tolist() == [0] and cl.subset([0]).element_s.tolist() == cl.element_s.tolist()


def test_element_work_costs_every_sequence_of_a_wave_and_of_a_micro_batch():
    w = toy_workload(micro_batch=2)
    rep = cost.ReplicaGen(flops=1e12, mem_bw=1e11, free=256 * 200 * 10, alpha=0.0, beta=math.inf)
    costly = dataclasses.replace(rep, element_s=2e-3)
    extra = cost.generation_time(TOY, w, costly, 1, 25) - cost.generation_time(TOY, w, rep, 1, 25)
    assert extra == pytest.approx(25 * 2e-3)  # three waves of 25/3 sequences
    # each stage does half the units of its micro-batch's 2 sequences at its own cost per sequence
    pipes = dataclasses.replace(two_stages(), stage_element_s=np.array([[[0, 1e-3, 3e-3], [0, 2e-3, 4e-3]]]))
    for train, per_sequence in ((False, 2e-3), (True, 4e-3)):
        paid = (
            cost.pipeline_slots(TOY, w, pipes, 1, train)[0]
            - cost.pipeline_slots(TOY, w, two_stages(), 1, train)[0]
        )
        assert paid == pytest.approx(2 * per_sequence / 2)


def _cluster(
    links: list[tuple[int, int, float]],
    tflops: float = 100.0,
    launch_us: tuple[float | None, ...] = (None,) * 3,
) -> Cluster:
    """Three devices in three regions with the given symmetric bandwidths (Mbit/s), 5 ms apart."""
    names = ["r0", "r1", "r2"]
    bw = [[1e6] * 3 for _ in range(3)]
    for a, b, v in links:
        bw[a][b] = bw[b][a] = v
    delay = [[0.0 if i == j else 5.0 for j in range(3)] for i in range(3)]
    devs = [
        Device(
            id=f"d{i}",
            region=names[i],
            tflops=tflops,
            memory_gb=1000,
            memory_bandwidth_gb_s=100,
            launch_us=launch_us[i],
        )
        for i in range(3)
    ]
    sc = Scenario(devices=devs, regions=Regions(names=names, delay_ms=delay, bandwidth_mbps=bw))  # type: ignore[arg-type]
    return Cluster.of(rl_scenario(sc, toy_workload()))


def _two_regions(order: tuple[str, ...] = ("r0", "r0", "r1", "r1")) -> Cluster:
    """Four devices (d0..d3 in ``order``'s regions): 1 Tbit/s and no delay inside a region, 8 Mbit/s
    (1e6 B/s) and 5 ms between the two."""
    names = ["r0", "r1"]
    bw = [[1e6, 8.0], [8.0, 1e6]]
    delay = [[0.0, 5.0], [5.0, 0.0]]
    devs = [
        Device(id=f"d{i}", region=r, tflops=1.0, memory_gb=1000, memory_bandwidth_gb_s=100)
        for i, r in enumerate(order)
    ]
    sc = Scenario(devices=devs, regions=Regions(names=names, delay_ms=delay, bandwidth_mbps=bw))  # type: ignore[arg-type]
    return Cluster.of(rl_scenario(sc, toy_workload()))


def test_star_sync_sends_one_copy_per_generator_from_the_best_sender():
    delay = np.array([[0.01, 0.02], [0.001, 0.001]])
    bw = np.array([[1e6, 2e6], [1e5, 1e5]])
    counts = np.array([2, 1])
    # sender 0: 0.02 + 2 x 1e6/1e6 + 1e6/2e6 = 2.52 s; sender 1: 0.001 + 3 x 10 s
    assert cost.sync_star(delay, bw, counts, 1e6) == pytest.approx(2.52)
    assert cost.sync_star(delay, bw, np.array([0, 0]), 1e6) == 0.0


def test_the_sync_adds_the_trainers_packing_and_the_slowest_generators_load():
    cl = _cluster([(0, 1, 8.0), (0, 2, 8.0)], tflops=1.0, launch_us=(1.0, 2.0, 4.0))
    host = Launches(publish=50, publish_bytes=2e6, load=100, load_bytes=1e6)
    plain, w = toy_workload(weight_sync="star"), toy_workload(weight_sync="star", launches=host)
    grouping = (("generate",), ("reference", "actor_train"))
    counts = [cl.counts_of([1, 2]), cl.counts_of([0])]
    extra = Evaluator(cl, w).sync_time(grouping, counts) - Evaluator(cl, plain).sync_time(grouping, counts)
    # d0 packs (50 ops at 1 µs, 2e6 bytes), then d2 loads slowest (100 ops at 4 µs, 1e6 bytes);
    # the bytes at 100 GB/s x 0.5 (HALF)
    assert extra == pytest.approx(50e-6 + 2e6 / 5e10 + 100 * 4e-6 + 1e6 / 5e10)
    # generation beside training: no sync, nothing packed or loaded
    assert Evaluator(cl, w).sync_time((("generate", "reference", "actor_train"),), [cl.counts_of([0])]) == 0.0


def test_a_star_workload_syncs_as_a_star_and_the_exact_mode_refuses_it():
    cl = _cluster([(0, 1, 8.0), (0, 2, 8.0)], tflops=1.0)  # d0 reaches d1 and d2 at 1e6 B/s, 5 ms
    w = toy_workload(weight_sync="star")
    ev = Evaluator(cl, w)
    grouping = (("generate",), ("reference", "actor_train"))
    counts = [cl.counts_of([1, 2]), cl.counts_of([0])]
    assert ev.sync_time(grouping, counts) == pytest.approx(0.005 + 2 * 2e9 / 1e6)
    relay = Evaluator(cl, toy_workload())
    assert relay.sync_time(grouping, counts) < ev.sync_time(grouping, counts)
    with pytest.raises(ConfigError, match="weight_sync"):
        exact.solve(ev, exact.ExactConfig())


def test_a_message_costs_its_sender_and_its_receiver_their_measured_host_time():
    """Where peers measured what a message costs their machine (``Device.message_us``), every
    message between them waits that long at each end: a link's delay grows by both (a tiny model's
    weight sync and rollout shards are mostly that host time)."""
    from peerd.sched.hosts import HostShare

    box = HostShare("box", cores=2)
    names = ["r0", "r1"]
    regions = Regions(names=names, delay_ms=[[0.0, 1.0], [1.0, 0.0]], bandwidth_mbps=[[1e6, 8e3], [8e3, 1e6]])
    devs = [
        Device(
            id=f"d{i}",
            region=names[i],
            tflops=1.0,
            memory_gb=100,
            memory_bandwidth_gb_s=10,
            host=box,
            message_us=us,
        )
        for i, us in enumerate((200.0, 300.0))
    ]
    cl = Cluster.of(rl_scenario(Scenario(devices=devs, regions=regions), toy_workload()))
    np.testing.assert_allclose(cl.delay, [[0.0, 1.5e-3], [1.5e-3, 0.0]])
    assert cl.cls[0] != cl.cls[1]  # unequal costs: not interchangeable
    bare = Cluster.of(
        rl_scenario(
            Scenario(devices=[dataclasses.replace(d, message_us=None) for d in devs], regions=regions),
            toy_workload(),
        )
    )
    # a star sync of 1 MB from d0 to d1 (1e6 B/s): the same bytes, one message's host time later
    extra = cost.sync_star(cl.delay[:1], cl.bw[:1], np.array([0, 1]), 1e6) - cost.sync_star(
        bare.delay[:1], bare.bw[:1], np.array([0, 1]), 1e6
    )
    assert extra == pytest.approx(500e-6)
