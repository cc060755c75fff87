"""One task group on its devices: each task's best layout, its time, and the memory it needs per device.

A group's tasks time-share its devices; each task independently takes the fastest layout that
fits in memory next to what the group parks (``peerd.sched.rl.memory``), so a group's result
depends only on its tasks and on how many devices of each class it holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from peerd.sched.rl import cost, memory
from peerd.sched.rl.cluster import Cluster
from peerd.sched.rl.layout import Layout, arrange, canonical_order, layouts
from peerd.sched.rl.workflow import KIND, ROLE
from peerd.sched.rl.workload import Workload


@dataclass(frozen=True)
class Shortfall:
    """Why a task fits nowhere in its group: the device short of memory and by how many bytes."""

    task: str
    device: str
    bytes: float

    def __str__(self) -> str:
        return f"{self.task} needs {self.bytes / 1e9:.2f} GB more on {self.device}"


@dataclass(frozen=True)
class TaskPlan:
    """A task's chosen layout, its seconds, its tasklet grid and its bytes per device."""

    task: str
    layout: Layout
    seconds: float
    grid: np.ndarray
    """(dp, pp, tp) device indices."""
    peak: dict[int, float]
    """Device index -> bytes held while this task runs (parked state included)."""
    allreduce_s: float = 0.0
    """Of ``seconds``, the data-parallel gradient all-reduces (a pipeline layout's training task)."""


@dataclass(frozen=True)
class GroupResult:
    tasks: tuple[str, ...]
    devices: tuple[int, ...]
    """In arrangement order."""
    plans: dict[str, TaskPlan]
    shortfall: Shortfall | None
    """Set when some task fits under no layout (then ``plans`` lacks it and ``busy`` is inf)."""

    @property
    def feasible(self) -> bool:
        return self.shortfall is None

    @property
    def busy(self) -> float:
        """Seconds the group's devices work per iteration (its tasks one after another)."""
        if not self.feasible:
            return math.inf
        return sum(p.seconds for p in self.plans.values())

    def seconds(self, task: str) -> float:
        return self.plans[task].seconds if task in self.plans else math.inf

    def peak_bytes(self) -> dict[int, float]:
        """Device index -> the most bytes it holds during any of the group's tasks."""
        out: dict[int, float] = {}
        for p in self.plans.values():
            for d, b in p.peak.items():
                out[d] = max(out.get(d, 0.0), b)
        return out


def evaluate_group(
    cluster: Cluster,
    w: Workload,
    tasks: tuple[str, ...],
    devices: list[int],
    balanced: bool = True,
    only: Mapping[str, Layout | Sequence[Layout]] | None = None,
) -> GroupResult:
    """Best layout of each task of ``tasks`` on ``devices`` (or among the layouts in ``only``).

    FSDP layouts in ``only`` (the verl-like baseline) must agree on their shard group size: the
    group's parked state is then sharded inside those groups (``shard_groups``).
    """
    ordered = canonical_order(cluster, devices)
    parked = np.zeros(cluster.n)
    total = memory.parked_total(w, tasks)
    shard = {lay.shard for opts in (only or {}).values() for lay in _as_list(opts) if lay.fsdp}
    assert len(shard) <= 1, "one FSDP shard group size per group"
    for g in shard_groups(devices, shard.pop() if shard else len(devices)):
        parked[g] = memory.parked_per_device(total, cluster.memory[g])
    plans: dict[str, TaskPlan] = {}
    worst: Shortfall | None = None
    for task in tasks:
        model = w.model(ROLE[task])
        options = (
            _as_list(only[task])
            if only and task in only
            else layouts(len(ordered), model.layers, model.kv_heads or model.heads, KIND[task] == "generate")
        )
        best: TaskPlan | None = None
        least: Shortfall | None = None
        for lay in options:
            plan, short = _task_on(cluster, w, task, lay, arrange(ordered, lay), parked, tasks, balanced)
            if plan is not None and (best is None or plan.seconds < best.seconds):
                best = plan
            if short is not None and (least is None or short.bytes < least.bytes):
                least = short
        if best is not None:
            plans[task] = best
        elif worst is None:
            worst = least or Shortfall(task, "?", math.inf)
    return GroupResult(tasks, tuple(ordered), plans, worst)


def _as_list(opts: Layout | Sequence[Layout]) -> list[Layout]:
    return [opts] if isinstance(opts, Layout) else list(opts)


def shard_groups(devices: Sequence[int] | np.ndarray, f: int) -> np.ndarray:
    """(n/f, f): FSDP shard groups of ``f`` consecutive devices in scenario order (verl's device
    mesh ``(n/f, f)`` over ranks in order; the columns are the replica groups)."""
    order = np.sort(np.asarray(devices, dtype=np.intp).ravel())
    assert order.size % f == 0, "the shard group size divides the devices"
    return order.reshape(order.size // f, f)


def _task_on(
    cluster: Cluster,
    w: Workload,
    task: str,
    lay: Layout,
    grid: np.ndarray,
    parked: np.ndarray,
    tasks: tuple[str, ...],
    balanced: bool,
) -> tuple[TaskPlan | None, Shortfall | None]:
    if KIND[task] == "generate":
        return _generate(cluster, w, task, lay, grid, parked, balanced)
    if lay.fsdp:
        return _fsdp_task(cluster, w, task, lay, grid, parked, "generate" in tasks)
    return _pipeline_task(cluster, w, task, lay, grid, parked, len(tasks), balanced)


def _generate(
    cluster: Cluster,
    w: Workload,
    task: str,
    lay: Layout,
    grid: np.ndarray,
    parked: np.ndarray,
    balanced: bool,
) -> tuple[TaskPlan | None, Shortfall | None]:
    model = w.model(ROLE[task])
    shard = memory.weight_shard(model, w, lay)
    kv_seq = memory.kv_per_sequence(model, w, lay.tp)
    devs = grid[:, 0, :]  # (dp, tp)
    room = (cluster.memory[devs] - parked[devs] - shard).min(axis=1)
    if room.min() < kv_seq:
        r = int(np.argmin(room))
        d = devs[r][int(np.argmin(cluster.memory[devs[r]] - parked[devs[r]]))]
        return None, Shortfall(task, cluster.ids[d], kv_seq - float(room.min()))
    pair_d = cluster.delay[devs[:, :, None], devs[:, None, :]]
    pair_b = cluster.bw[devs[:, :, None], devs[:, None, :]]
    reps = [
        cost.ReplicaGen(
            flops=lay.tp * float(f),
            mem_bw=lay.tp * float(b),
            free=float(fr),
            alpha=float(a),
            beta=float(bt),
            launch=float(ln),
            element_s=float(el) / lay.tp,
        )
        for f, b, fr, a, bt, ln, el in zip(
            cluster.flops[devs].min(axis=1),
            cluster.mem_bw[devs].min(axis=1),
            room,
            pair_d.max(axis=(1, 2)),
            pair_b.min(axis=(1, 2)),
            cluster.launch[devs].max(axis=1),
            cluster.element_s[devs, 0].max(axis=1),
            strict=True,
        )
    ]
    split = cost.balanced_split(
        w.sequences, lay.dp, lambda r, s: cost.generation_time(model, w, reps[r], lay.tp, s), balanced
    )
    seconds = max(cost.generation_time(model, w, reps[r], lay.tp, s) for r, s in enumerate(split))
    peak = {}
    for r, s in enumerate(split):
        cap = math.floor(reps[r].free / kv_seq)  # as in cost.generation_time
        live = math.ceil(s / math.ceil(s / cap)) if s > 0 else 0
        for d in grid[r, 0, :]:
            peak[int(d)] = float(parked[d] + shard + live * kv_seq)
    return TaskPlan(task, lay, seconds, grid, peak), None


def _pipeline_task(
    cluster: Cluster,
    w: Workload,
    task: str,
    lay: Layout,
    grid: np.ndarray,
    parked: np.ndarray,
    n_tasks: int,
    balanced: bool,
) -> tuple[TaskPlan | None, Shortfall | None]:
    model = w.model(ROLE[task])
    train = KIND[task] == "train"
    if train:
        stage_bytes = memory.training_stage_bytes(model, w, lay, optimizer_local=n_tasks == 1)
    else:
        stage_bytes = memory.inference_stage_bytes(model, w, lay)
    need = stage_bytes[None, :, None] + parked[grid]  # (dp, pp, tp)
    over = need - cluster.memory[grid]
    if over.max() > 0:
        d = grid.flat[int(np.argmax(over))]
        return None, Shortfall(task, cluster.ids[d], float(over.max()))
    slots = cost.pipeline_slots(model, w, cost.Pipelines.of(cluster, grid), lay.tp, train)
    per_step = w.optimizer_steps if train else 1

    def replica_time(r: int, seqs: float) -> float:
        micro = math.ceil(seqs / (w.micro_batch * per_step) - 1e-9) if seqs > 0 else 0
        return cost.pipeline_time(micro, lay.pp, slots[r])

    split = cost.balanced_split(w.sequences, lay.dp, replica_time, balanced)
    pipe = max(replica_time(r, s) for r, s in enumerate(split))
    setup, step_ops = cost.task_launches(
        w,
        train,
        lay.pp,
        float(cluster.launch[grid].max()),
        float(cluster.mem_bw[grid].min()),
    )
    if train:
        grads = model.params / (lay.pp * lay.tp) * w.constants.allreduce_grad_bytes()
        ar = 0.0
        if lay.dp > 1:  # the dp devices of each (stage, rank) all-reduce; extremes over their pairs
            pair_d = cluster.delay[grid[:, None], grid[None, :]]  # (dp, dp, pp, tp)
            pair_b = cluster.bw[grid[:, None], grid[None, :]]
            alpha, beta = pair_d.max(axis=(0, 1)), pair_b.min(axis=(0, 1))
            ar = max(
                cost.allreduce(grads, lay.dp, float(a), float(b))
                for a, b in zip(alpha.ravel(), beta.ravel(), strict=True)
            )
        seconds = per_step * (pipe + ar + step_ops) + setup
    else:
        ar, seconds = 0.0, pipe + setup
    peak = {int(d): float(b) for d, b in zip(grid.ravel(), need.ravel(), strict=True)}
    return TaskPlan(task, lay, seconds, grid, peak, per_step * ar), None


def _fsdp_task(
    cluster: Cluster,
    w: Workload,
    task: str,
    lay: Layout,
    grid: np.ndarray,
    parked: np.ndarray,
    with_generation: bool,
) -> tuple[TaskPlan | None, Shortfall | None]:
    """A ZeRO-3 / HSDP task over all ``lay.dp`` devices (see ``cost``): equal shares, lockstep micro-batches."""
    if lay.micro_batch:
        w = dataclasses.replace(w, micro_batch=lay.micro_batch)
    model = w.model(ROLE[task])
    train = KIND[task] == "train"
    f = lay.shard
    groups = shard_groups(grid, f)  # (r, f)
    devs = groups.ravel()
    need = memory.fsdp_bytes(model, w, f, train) + parked[devs]
    over = need - cluster.memory[devs]
    if over.max() > 0:
        d = devs[int(np.argmax(over))]
        return None, Shortfall(task, cluster.ids[d], float(over.max()))
    compute = cost.pipeline_slots(model, w, cost.Pipelines.of(cluster, grid), 1, train)
    gathers = [cost.link_extremes(cluster, g) for g in groups]
    collectives = max(cost.fsdp_collectives(model, w, f, a, b, train) for a, b in gathers)
    if train and groups.shape[0] > 1:  # HSDP: the gradient shards' all-reduce across replicas
        collectives += max(
            cost.hsdp_allreduce(model, w, f, groups.shape[0], *cost.link_extremes(cluster, col))
            for col in groups.T
        )
    slot = max(float(compute.max()), collectives)
    steps = w.optimizer_steps if train else 1
    micro = math.ceil(w.sequences / (lay.dp * w.micro_batch * steps) - 1e-9)
    setup, step_ops = cost.task_launches(
        w,
        train,
        1,
        float(cluster.launch[devs].max()),
        float(cluster.mem_bw[devs].min()),
    )
    seconds = steps * (micro * slot + step_ops) + setup
    if task == "actor_train" and with_generation:  # reshard into the rollout engine's layout
        weights = model.params * w.constants.weight_bytes
        seconds += max(cost.allgather(weights, f, a, b) for a, b in gathers)
    peak = {int(d): float(b) for d, b in zip(devs, need, strict=True)}
    return TaskPlan(task, lay, seconds, grid, peak), None
