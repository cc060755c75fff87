"""The shared cost model of ``kind: rl`` jobs: a roster and a role assignment -> predicted seconds per GRPO iteration.

An rl job's candidate allocation has one tasklet (1 x 1): its peer is the **trainer** (the
actor's updates and the reference's log-probs, ``reference + actor_train``); the allocation's
spares are the **rollout peers** (``generate``: each samples an equal share of the iteration's
prompts, as ``peerd.jobs.rl`` runs it). Every peer re-scores a candidate with the RL cost model
(``peerd.sched.rl``) on the roster alone, so the consensus compares role assignments with the
same arithmetic as ``peerd plan --kind rl``:

- the roster becomes a cluster: measured fp32 TFLOPS, free memory and memory bandwidth of
  every entry (``RosterDevice``; achieved rates, so at efficiency 1), links as
  ``peerd.jobs.scoring.roster_scenario`` reads them;
- the spec becomes a ``Workload``: the built-in GPT's sizes, ``global_batch / group_size``
  prompts of the task's longest prompt, ``max_new_tokens`` decode steps, one optimizer update
  per ``micro_batch`` completions (times ``epochs``), staleness ``k``, fp32 everywhere (what the
  runtime computes in: 4-byte weights, gradients, KV cache and two Adam moments), and the ops the
  runtime dispatches per unit of work, counted on its own code (``peerd.rl.launches``; each costs
  the peer's measured ``launch_s``);
- the weights reach the rollout peers as the runtime sends them: each from the trainer
  (``weight_sync: star``);
- the plan is the grouping ``generate | reference + actor_train`` with the layouts the runtime
  runs (data-parallel generation over the rollout peers with equal shares, one trainer); its
  iteration time (sync: the critical path; async: the steady state) is the cost.

A roster entry without a measured memory bandwidth (a peer older than that measurement) cannot
be scored for an rl job: ``ConfigError`` naming it, so such a roster keeps planning.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from peerd.errors import ConfigError
from peerd.jobs.optimizer import optimizer_config
from peerd.jobs.scoring import CACHE_ROSTERS, JobModel, RosterScorer, job_model, roster_scenario
from peerd.jobs.spec import JobSpec
from peerd.pipeline.optim import build_optimizer, build_scheduler
from peerd.rl.launches import IterationShape, count_launches
from peerd.rl.tasks import make_task
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import Roster
from peerd.sched.evolution import SearchConfig
from peerd.sched.rl.cluster import Cluster, rl_scenario
from peerd.sched.rl.evaluate import Evaluator
from peerd.sched.rl.group import GroupResult, evaluate_group
from peerd.sched.rl.layout import Layout
from peerd.sched.rl.workload import CostConstants, ModelSize, Workload
from peerd.sched.scenario import Scenario

ROLLOUT_TASKS = ("generate",)
TRAINER_TASKS = ("reference", "actor_train")
GROUPING = (ROLLOUT_TASKS, TRAINER_TASKS)

# The runtime trains and samples in fp32 with AdamW (two fp32 moments, no separate master copy).
# A roster's TFLOPS and memory bandwidth are rates its peers achieved (a matmul, a copy), not
# datasheet peaks: the efficiencies that turn peaks into achieved rates are 1 here, as in the
# pretraining cost model (at 0.4 the model priced a width-128 reference pass 2.2x its measured time).
FP32 = CostConstants(
    compute_efficiency=1.0,
    memory_efficiency=1.0,
    weight_bytes=4.0,
    grad_bytes=4.0,
    optimizer_bytes=8.0,
    kv_bytes=4.0,
    activation_bytes=4.0,
    logit_bytes=4.0,
    recompute=False,
)


def rl_workload(spec: JobSpec) -> Workload:
    """The RL cost model's view of an rl job spec (see the module docstring)."""
    if spec.kind != "rl" or spec.model.preset is None:
        raise ConfigError("kind", "only an rl job of a built-in GPT has an RL workload")
    rl, cfg = spec.rl_settings(), spec.model.gpt_config()
    task = make_task(rl.task)
    seq = task.max_prompt_len + rl.sampling.max_new_tokens
    params = sum(c.params for c in spec.model.family().layer_costs(seq))
    actor = ModelSize(
        params=float(params),
        layers=cfg.n_layer,
        hidden=cfg.d_model,
        heads=cfg.n_head,
        vocab=cfg.vocab_size,
        name=spec.model.preset,
    )
    shape = IterationShape(
        task=task,
        sampling=rl.sampling,
        group_size=rl.group_size,
        prompts=spec.global_batch // rl.group_size,
        groups_per_update=spec.micro_batch // rl.group_size,
        loss=rl.loss,
        grad_clip=spec.optimizer.grad_clip,
    )
    optimizer = optimizer_config(spec.optimizer)

    def runtime_optimizer(
        params: Iterable[torch.nn.Parameter],
    ) -> tuple[torch.optim.Optimizer, Callable[[], object]]:
        built = build_optimizer(params, optimizer)  # and its schedule, as the trainer steps it
        return built, build_scheduler(built, optimizer, spec.steps * shape.prompts).step

    return Workload(
        actor=actor,
        launches=count_launches(cfg, shape, runtime_optimizer),
        prompts=spec.global_batch // rl.group_size,
        responses_per_prompt=rl.group_size,
        prompt_len=task.max_prompt_len,
        response_len=rl.sampling.max_new_tokens,
        micro_batch=spec.micro_batch,
        optimizer_steps=spec.global_batch // spec.micro_batch * rl.epochs,
        staleness=rl.staleness,
        weight_sync="star",  # every rollout peer takes the weights from the trainer
        name=spec.name or f"rl-{rl.task.name}",
        constants=FP32,
    )


@dataclass(frozen=True)
class Prediction:
    """One role assignment's predicted iteration and its parts (seconds)."""

    seconds: float
    tasks: dict[str, float]
    """Seconds of generate, reference and actor_train."""
    sync: float
    """Weight sync trainer -> rollout peers."""
    transfers: float
    """Rollouts rollout peers -> trainer."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Model:
    """One roster's cluster and evaluator, with the device index of each peer."""

    def __init__(self, scenario: Scenario, workload: Workload) -> None:
        self.scenario = scenario
        self.cluster = Cluster.of(rl_scenario(scenario, workload))
        # Equal shares: the runtime splits an iteration's prompts evenly over the rollout peers.
        self.evaluator = Evaluator(self.cluster, workload, balanced=False)
        self.index = {d.id: i for i, d in enumerate(scenario.devices)}

    def predict(self, trainer: str, rollouts: tuple[str, ...]) -> Prediction:
        w, cl = self.evaluator.workload, self.cluster
        for peer in (trainer, *rollouts):
            if peer not in self.index:
                raise ConfigError("allocation", f"{peer} is not in the roster")
        gen_idx = [self.index[p] for p in rollouts]
        train_idx = [self.index[trainer]]
        gen = evaluate_group(cl, w, ROLLOUT_TASKS, gen_idx, False, {"generate": Layout(len(gen_idx), 1, 1)})
        train = evaluate_group(
            cl, w, TRAINER_TASKS, train_idx, False, {t: Layout(1, 1, 1) for t in TRAINER_TASKS}
        )
        _fits(gen)
        _fits(train)
        self.evaluator.evaluations += 1
        counts = [cl.counts_of(gen_idx), cl.counts_of(train_idx)]
        parts = self.evaluator.combine(GROUPING, counts, [gen, train])
        seconds = float(parts["seconds"])
        if not math.isfinite(seconds):
            raise ConfigError("allocation", "scored as infinite")
        return Prediction(
            seconds=seconds,
            tasks={t: float(v) for t, v in parts["tasks"].items()},
            sync=float(parts["sync"]),
            transfers=float(sum(parts["transfers"].values())),
        )


def _fits(result: GroupResult) -> None:
    if result.shortfall is not None:
        raise ConfigError("allocation", f"does not fit the peers' memory: {result.shortfall}")


def roles(allocation: Allocation) -> tuple[str, tuple[str, ...]]:
    """(trainer, rollout peers) of an rl job's allocation; ConfigError if it is not one."""
    if allocation.d_pp != 1 or allocation.d_dp != 1:
        raise ConfigError(
            "stages", f"an rl job runs one trainer (1 x 1), got {allocation.d_pp} x {allocation.d_dp}"
        )
    if not allocation.spares:
        raise ConfigError("spares", "an rl job needs at least one rollout peer")
    return allocation.devices[0], tuple(sorted(allocation.spares))


class RLRosterScorer:
    """``score(roster, allocation) -> predicted seconds per iteration`` of an rl job, cached per roster.

    The same interface as ``peerd.jobs.scoring.RosterScorer`` (the planner holds either).
    """

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.jm = job_model(spec)
        self.workload = rl_workload(spec)
        self._models: OrderedDict[bytes, _Model] = OrderedDict()
        self.evaluations = 0

    def scenario(self, roster: Roster) -> Scenario:
        """The roster as a scenario, each device with the memory bandwidth its entry declares."""
        return self._model(roster).scenario

    def _model(self, roster: Roster) -> _Model:
        key = roster.digest
        found = self._models.get(key)
        if found is None:
            found = self._models[key] = _Model(with_bandwidths(roster, self.jm), self.workload)
            while len(self._models) > CACHE_ROSTERS:
                self._models.popitem(last=False)
        return found

    def predict(self, roster: Roster, allocation: Allocation) -> Prediction:
        trainer, rollouts = roles(allocation)
        return self._model(roster).predict(trainer, rollouts)

    def __call__(self, roster: Roster, allocation: Allocation) -> float:
        self.evaluations += 1
        return self.predict(roster, allocation).seconds

    def island(
        self, scenario: Scenario, seed: int, time_budget: float, config: SearchConfig | None = None
    ) -> RoleIsland:
        """A search over role assignments of ``scenario`` (``seed`` and ``config`` unused: it is exhaustive)."""
        return RoleIsland(_Model(scenario, self.workload), self.spec.max_peers)


def with_bandwidths(roster: Roster, jm: JobModel) -> Scenario:
    """``roster_scenario`` with every device's memory bandwidth and seconds per op from its roster entry
    (a peer that predates the op measurement is priced without launches)."""
    base = roster_scenario(roster, jm)
    measured: dict[str, tuple[float, float | None]] = {}
    for i, e in enumerate(roster.entries):
        if e.profile.memory_bandwidth is None:
            raise ConfigError(
                f"roster.entries[{i}].profile.memory_bandwidth",
                f"peer {e.peer} did not measure its memory bandwidth: an rl job cannot time its generation",
            )
        launch_us = e.profile.launch_s * 1e6 if e.profile.launch_s is not None else None
        measured[e.peer] = (e.profile.memory_bandwidth / 1e9, launch_us)
    devices = [
        dataclasses.replace(d, memory_bandwidth_gb_s=measured[d.id][0], launch_us=measured[d.id][1])
        for d in base.devices
    ]
    return dataclasses.replace(base, devices=devices)


def scorer_for(spec: JobSpec) -> RosterScorer | RLRosterScorer:
    """The cost model every peer of ``spec``'s job scores candidates with: by the job's kind."""
    return RLRosterScorer(spec) if spec.kind == "rl" else RosterScorer(spec)


class _Counter:
    def __init__(self) -> None:
        self.evaluations = 0


class RoleIsland:
    """Role assignments searched exhaustively over the trainer, then greedily over the rollout set.

    Every peer is tried as the trainer with every other peer rolling out (n evaluations); then each
    ``step`` drops the rollout peer whose removal helps most (a slow or badly linked peer can cost
    its equal share more than it adds), until nothing helps. Deterministic; the interface is the one
    ``peerd.jobs.island.IslandThread`` drives (``step``, ``best``, ``best_cost``, ``accept``).
    """

    def __init__(self, model: _Model, max_peers: int | None) -> None:
        self.model = model
        self.obj = _Counter()
        self.generation = 0
        self._best: tuple[float, Allocation] | None = None
        peers = sorted(model.index)
        limit = max_peers or len(peers)
        for trainer in peers:
            others = tuple(p for p in peers if p != trainer)[: max(limit - 1, 0)]
            if others:
                self._consider(trainer, others)
        self._frozen = False

    def _consider(self, trainer: str, rollouts: tuple[str, ...]) -> float:
        self.obj.evaluations += 1
        try:
            cost = self.model.predict(trainer, rollouts).seconds
        except ConfigError:
            return math.inf
        alloc = Allocation(((trainer,),), tuple(sorted(rollouts)))
        if self._best is None or (cost, alloc.digest()) < (self._best[0], self._best[1].digest()):
            self._best = (cost, alloc)
        return cost

    def step(self, generations: int = 1, deadline: float | None = None) -> bool:
        for _ in range(generations):
            self.generation += 1
            if self._best is None or self._frozen:
                return False
            cost, alloc = self._best
            trainer, rollouts = alloc.devices[0], alloc.spares
            if len(rollouts) < 2:
                self._frozen = True
                return False
            for drop in rollouts:
                self._consider(trainer, tuple(p for p in rollouts if p != drop))
            if self._best[0] >= cost:
                self._frozen = True
        return True

    def best(self, k: int = 1) -> list[Allocation]:
        return [self._best[1]] if self._best is not None else []

    def best_cost(self) -> float:
        return self._best[0] if self._best is not None else math.inf

    def accept(self, migrants: Any) -> int:
        taken = 0
        for m in migrants:
            alloc = m if isinstance(m, Allocation) else Allocation.from_plain(m)
            try:
                trainer, rollouts = roles(alloc)
            except ConfigError:
                continue
            before = self.best_cost()
            if self._consider(trainer, rollouts) < before:
                taken += 1
                self._frozen = False
        return taken
