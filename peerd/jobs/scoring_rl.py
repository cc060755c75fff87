"""The shared cost model of ``kind: rl`` jobs: a roster and a role assignment -> predicted seconds per GRPO iteration.

An rl job's candidate allocation has one stage of R replicas (R = the spec's ``parallel.d_dp``;
with ``auto`` any R that splits an update's groups equally, ``JobSpec.rl_trainer_counts``, and the
search, ``RoleSearch``, chooses): its peers are the R **trainers** in replica order (each computes the
reference's log-probs and the actor's updates, ``reference + actor_train``, on its own 1/R of the
iteration's prompts); the allocation's spares are the **rollout peers** (``generate``). As
``peerd.jobs.rl`` runs it, the rollout peers sorted by id are dealt round-robin (rollout peer i
serves trainer i % R) and split their trainer's prompts equally; a trainer left without a rollout
peer samples its own prompts (colocated: generation time-shares its device, before its reference
pass). No spares at all is the verl-like colocated plan: every trainer generates, scores and trains
its share (with R = 1, a lone trainer). An allocation keeps at least ``rl.min_rollout_peers``
rollout peers where the roster has them (``required_rollouts``); scoring refuses one with fewer.
Every peer re-scores a candidate with the RL cost model (``peerd.sched.rl``) on the roster alone,
so the consensus compares role assignments with the same arithmetic as ``peerd plan --kind rl``:

- the roster becomes a cluster: measured fp32 TFLOPS, free memory and memory bandwidth of
  every entry (``RosterDevice``; achieved rates, so at efficiency 1), links as
  ``peerd.jobs.scoring.roster_scenario`` reads them, each message also costing the host time its
  sender and its receiver measured (``message_s``: a delay of the link, ``sched.rl.cluster``);
- the spec becomes a ``Workload``: the built-in GPT's sizes, ``global_batch / group_size``
  prompts of the task's longest prompt, ``max_new_tokens`` decode steps, one optimizer update
  per ``micro_batch`` completions (times ``epochs``), staleness ``k``, fp32 everywhere (what the
  runtime computes in: 4-byte weights, gradients, KV cache and two Adam moments), and the ops the
  runtime dispatches per unit of work, counted on its own code (``peerd.rl.launches``; each costs
  the peer's measured ``launch_s``);
- training is data parallel over the trainers (``sched.rl``'s ``Layout(R, 1, 1)``): each update
  is one pass over a trainer's share of the update's groups, then the trainers average their
  gradients (fp32, or ``compression.gradient_bits`` per element plus the codec's scales:
  ``peerd.jobs.rl.means``) with a ring all-reduce, ``2(R-1)/R`` of the gradient bytes over the slowest link
  between trainers plus ``2(R-1)`` of the largest delay, once per optimizer update;
- the weights reach the rollout peers as the runtime sends them: each trainer packs them
  (``peerd.rl.weights``) and sends them to its own rollout peers (``weight_sync: star``, the R
  stars in parallel), each of which checks and loads them (the ops and bytes of both counted on
  the runtime's functions, ``peerd.rl.launches.count_sync``); a colocated trainer needs no sync;
- peers whose CPU devices share one machine's cores (the entries' ``host``) slow each other while
  more of their threads compute at once than the machine has cores (``peerd.sched.hosts``), and
  the loopback links between them (the trainers' all-reduce on one machine) slow as much: in
  sync mode the rollout peers and the trainers that sample their own share compute together, then
  the trainers; in async mode every peer computes all the time;
- one trainer's iteration is its generation (on its rollout peers, or on itself), the rollouts'
  transfer, its reference pass, the data-parallel training (the all-reduces keep the trainers in
  step) and its weight sync; the iteration (sync: the critical path; async: the steady state) is
  the slowest trainer's (``_Model.predict``).

A roster entry without a measured memory bandwidth (a peer older than that measurement) cannot
be scored for an rl job: ``ConfigError`` naming it, so such a roster keeps planning.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from peerd.averaging import GradientCompression
from peerd.errors import ConfigError
from peerd.jobs.optimizer import optimizer_config
from peerd.jobs.scoring import CACHE_ROSTERS, JobModel, RosterScorer, job_model, roster_scenario
from peerd.jobs.spec import JobSpec
from peerd.models.costs import matmul_params
from peerd.pipeline.optim import build_optimizer, build_scheduler
from peerd.rl.launches import IterationShape, count_launches
from peerd.rl.tasks import make_task
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import Roster
from peerd.sched.evolution import SearchConfig
from peerd.sched.hosts import loopback_factors, slowdowns
from peerd.sched.rl.cluster import Cluster, rl_scenario
from peerd.sched.rl.evaluate import Evaluator
from peerd.sched.rl.group import GroupResult, evaluate_group
from peerd.sched.rl.layout import Layout
from peerd.sched.rl.workload import CostConstants, ModelSize, Workload
from peerd.sched.scenario import Scenario

ROLLOUT_TASKS = ("generate",)
TRAINER_TASKS = ("reference", "actor_train")
GROUPING = (ROLLOUT_TASKS, TRAINER_TASKS)
ALL_TASKS = ROLLOUT_TASKS + TRAINER_TASKS
COLOCATED = (ALL_TASKS,)
SLOWED_CLUSTERS = 16  # a roster's clusters with some peers slowed by their machine's other peers, kept

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


def gradient_wire_bytes(spec: JobSpec) -> float | None:
    """Bytes per gradient element on the trainers' averaging wire (None: fp32, ``grad_bytes``)."""
    bits = spec.compression.gradient_bits
    return None if bits is None else GradientCompression(bits=bits).bytes_per_value()


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
        matmul_params=float(matmul_params(cfg)),
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
        constants=dataclasses.replace(FP32, grad_wire_bytes=gradient_wire_bytes(spec)),
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
    average: float = 0.0
    """Of ``tasks["actor_train"]``, the trainers' gradient all-reduces (0 for a lone trainer)."""

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
        self._shares: dict[int, Evaluator] = {1: self.evaluator}
        self.hosts = [d.host for d in scenario.devices]
        self._slowed: OrderedDict[tuple[float, ...], Cluster] = OrderedDict()

    def busy_cluster(self, busy: Iterable[str]) -> Cluster:
        """The cluster while the peers ``busy`` compute at once: the rates of those that share a
        machine's cores with more threads than it has divided by their slowdown, and the loopback
        links on such a machine slowed as much (``sched.hosts``)."""
        factors = tuple(slowdowns(self.hosts, {self.index[p] for p in busy}))
        if max(factors) == 1.0:
            return self.cluster
        found = self._slowed.get(factors)
        if found is None:
            f, cl = np.asarray(factors), self.cluster
            links = np.asarray(loopback_factors(self.hosts, factors))
            found = dataclasses.replace(
                cl,
                flops=cl.flops / f,
                mem_bw=cl.mem_bw / f,
                launch=cl.launch * f,
                element_s=cl.element_s * f[:, None],
                delay=cl.delay * links,
                bw=cl.bw / links,
            )
            self._slowed[factors] = found
            while len(self._slowed) > SLOWED_CLUSTERS:
                self._slowed.popitem(last=False)
        return found

    def predict(self, trainers: tuple[str, ...], rollouts: tuple[str, ...]) -> Prediction:
        """Seconds per iteration of ``trainers`` (replica order) and ``rollouts`` (sorted), and its parts.

        Each trainer's own plan is priced as a two- or one-group plan of ``sched.rl`` on its share of
        the prompts (``Evaluator.combine``): ``generate | reference + actor_train`` with its rollout
        peers (their transfers and its star sync), or all three tasks on itself when it has none.
        Both take the reference and training times of the data-parallel group of all trainers, and
        the iteration is the slowest trainer's plan; the parts are the largest over the trainers.
        A mix of both kinds (fewer rollout peers than trainers) is priced the same way, each trainer
        by its own kind: the colocated ones wait on their own generation, the others on their
        rollout peers', and the all-reduces make every trainer wait for the slowest.
        """
        w, cl = self.evaluator.workload, self.cluster
        for peer in (*trainers, *rollouts):
            if peer not in self.index:
                raise ConfigError("allocation", f"{peer} is not in the roster")
        replicas = len(trainers)
        if replicas < 1:
            raise ConfigError("stages", "an rl job needs a trainer")
        if w.prompts % replicas:
            raise ConfigError(
                "parallel.d_dp", f"{w.prompts} prompts per iteration do not split over {replicas} trainers"
            )
        share = self._share(replicas)
        served = [rollouts[r::replicas] for r in range(replicas)]  # rollout peer i serves trainer i % R
        train_idx = [self.index[t] for t in trainers]
        # Who computes at once (peers sharing a machine's cores slow each other): in sync mode the
        # rollout peers and the trainers that sample their own share, then the trainers; in async
        # mode every peer all the time.
        if w.staleness:
            cl_gen = cl_train = self.busy_cluster((*trainers, *rollouts))
        else:
            own = (t for t, peers in zip(trainers, served, strict=True) if not peers)
            cl_gen, cl_train = self.busy_cluster((*rollouts, *own)), self.busy_cluster(trainers)
        gens = [
            evaluate_group(
                cl_gen, share.workload, ROLLOUT_TASKS, idx, False, {"generate": Layout(len(idx), 1, 1)}
            )
            if idx
            else None
            for idx in ([self.index[p] for p in peers] for peers in served)
        ]
        # Layout(R, 1, 1): replica r takes 1/R of the sequences (balanced=False: equal shares) in
        # micro-batches of its share of an update, then per update the ring all-reduce of the fp32
        # gradients among the R trainers (group._pipeline_task; 0 for R = 1).
        train = evaluate_group(
            cl_train,
            self._per_update(w, replicas),
            TRAINER_TASKS,
            train_idx,
            False,
            {t: Layout(replicas, 1, 1) for t in TRAINER_TASKS},
        )
        # The group spreads its parked state over its devices, but every trainer holds a whole
        # replica: check each one's memory alone (and time a colocated trainer's own generation).
        solos = [
            evaluate_group(
                cl_gen,
                share.workload,
                TRAINER_TASKS if peers else ALL_TASKS,
                [i],
                False,
                {t: Layout(1, 1, 1) for t in ALL_TASKS},
            )
            if replicas > 1 or not peers
            else None
            for i, peers in zip(train_idx, served, strict=True)
        ]
        for result in (*gens, train, *solos):
            if result is not None:
                _fits(result)
        self.evaluator.evaluations += 1
        parts = [
            share.combine(GROUPING, [cl.counts_of(list(gen.devices)), cl.counts_of([i])], [gen, train])
            for i, gen in zip(train_idx, gens, strict=True)
            if gen is not None
        ]
        alone = [s for s, gen in zip(solos, gens, strict=True) if s is not None and gen is None]
        if alone:
            slowest = max((s.plans["generate"] for s in alone), key=lambda p: p.seconds)
            colocated = dataclasses.replace(
                train, tasks=ALL_TASKS, plans={"generate": slowest, **train.plans}
            )
            parts.append(share.combine(COLOCATED, [cl.counts_of(train_idx)], [colocated]))
        seconds = max(float(p["seconds"]) for p in parts)
        if not math.isfinite(seconds):
            raise ConfigError("allocation", "scored as infinite")
        return Prediction(
            seconds=seconds,
            tasks={t: max(float(p["tasks"][t]) for p in parts) for t in ALL_TASKS},
            sync=max(float(p["sync"]) for p in parts),
            transfers=max(float(sum(p["transfers"].values())) for p in parts),
            average=train.plans["actor_train"].allreduce_s,
        )

    def _share(self, replicas: int) -> Evaluator:
        """The evaluator of one trainer's share of the iteration: its prompts and its part of each update."""
        found = self._shares.get(replicas)
        if found is None:
            w = self._per_update(self.evaluator.workload, replicas)
            w = dataclasses.replace(w, prompts=w.prompts // replicas)
            found = self._shares[replicas] = Evaluator(self.cluster, w, balanced=False)
        return found

    @staticmethod
    def _per_update(w: Workload, replicas: int) -> Workload:
        """``w`` with a micro-batch of one trainer's part of an update: the update's groups split over
        the trainers, the largest part setting the pace (the runtime makes one pass per update)."""
        if replicas == 1:
            return w
        groups = w.micro_batch // w.responses_per_prompt
        return dataclasses.replace(w, micro_batch=-(-groups // replicas) * w.responses_per_prompt)


def _fits(result: GroupResult) -> None:
    if result.shortfall is not None:
        raise ConfigError("allocation", f"does not fit the peers' memory: {result.shortfall}")


def roles(allocation: Allocation) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(trainers in replica order, rollout peers sorted) of an rl job's allocation; ConfigError if it is not one.

    No rollout peer is valid: every trainer then generates its own share (the colocated plan).
    """
    if allocation.d_pp != 1 or not allocation.stages[0]:
        raise ConfigError(
            "stages", f"an rl job runs its trainers as one stage (d_pp 1), got {allocation.d_pp} stages"
        )
    trainers, rollouts = tuple(allocation.stages[0]), tuple(sorted(allocation.spares))
    if len({*trainers, *rollouts}) != len(trainers) + len(rollouts):
        raise ConfigError("allocation", "a peer holds two roles")
    return trainers, rollouts


class RLRosterScorer:
    """``score(roster, allocation) -> predicted seconds per iteration`` of an rl job, cached per roster.

    The same interface as ``peerd.jobs.scoring.RosterScorer`` (the planner holds either). ``workload``
    replaces the spec's (``rl_workload``), e.g. to price a variant of it.
    """

    def __init__(self, spec: JobSpec, workload: Workload | None = None) -> None:
        self.spec = spec
        self.jm = job_model(spec)
        self.workload = workload or rl_workload(spec)
        # how many trainers the job may run (``parallel.d_dp``, or with ``auto`` each count that
        # splits an update's groups equally): an allocation with another count is refused
        self.trainer_counts = spec.rl_trainer_counts()
        self.min_rollouts = spec.rl_settings().min_rollout_peers
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
        trainers, rollouts = roles(allocation)
        if len(trainers) not in self.trainer_counts:
            counts = " or ".join(map(str, self.trainer_counts))
            raise ConfigError(
                "stages", f"the job runs {counts} trainer(s), the allocation has {len(trainers)}"
            )
        fewest = min(self.trainer_counts)  # more trainers than the fewest leave the rollout peers' room
        need = required_rollouts(self.min_rollouts, len(roster.entries), self.spec.max_peers, fewest)
        if len(rollouts) < need:
            raise ConfigError(
                "rl.min_rollout_peers",
                f"the job keeps {need} rollout peer(s) on this roster, got {len(rollouts)}",
            )
        return self._model(roster).predict(trainers, rollouts)

    def __call__(self, roster: Roster, allocation: Allocation) -> float:
        self.evaluations += 1
        return self.predict(roster, allocation).seconds

    def island(
        self, scenario: Scenario, seed: int, time_budget: float, config: SearchConfig | None = None
    ) -> RoleSearch:
        """A search over role assignments of ``scenario`` (``seed`` and ``config`` unused: it is deterministic)."""
        return RoleSearch(
            _Model(scenario, self.workload), self.spec.max_peers, self.trainer_counts, self.min_rollouts
        )


def required_rollouts(min_rollouts: int, roster: int, max_peers: int | None, replicas: int) -> int:
    """The rollout peers an allocation must keep: ``rl.min_rollout_peers``, or as many peers as the
    roster (within ``max_peers``) has beyond ``replicas`` trainers (the fewest the job may run),
    whichever is fewer (a job that lost peers runs on with fewer instead of stalling; ``auto``
    does not take the rollout peers' places for trainers)."""
    room = min(roster, max_peers or roster) - replicas
    return max(0, min(min_rollouts, room))


def with_bandwidths(roster: Roster, jm: JobModel) -> Scenario:
    """``roster_scenario`` (each device's memory bandwidth, seconds per op and per element unit, and the
    machine it shares, from its roster entry), refusing an entry without a memory bandwidth: an rl job
    cannot time its generation without it (a peer that predates the op measurement is priced without
    launches)."""
    for i, e in enumerate(roster.entries):
        if e.profile.memory_bandwidth is None:
            raise ConfigError(
                f"roster.entries[{i}].profile.memory_bandwidth",
                f"peer {e.peer} did not measure its memory bandwidth: an rl job cannot time its generation",
            )
    return roster_scenario(roster, jm)


def scorer_for(spec: JobSpec) -> RosterScorer | RLRosterScorer:
    """The cost model every peer of ``spec``'s job scores candidates with: by the job's kind."""
    return RLRosterScorer(spec) if spec.kind == "rl" else RosterScorer(spec)


class _Counter:
    def __init__(self) -> None:
        self.evaluations = 0


class RoleIsland:
    """Role assignments of R trainers and their rollout peers, searched deterministically.

    One trainer (R = 1): every peer is tried as the trainer with every other peer rolling out, and
    alone (2n evaluations); then each ``step`` drops the rollout peer whose removal helps most (a
    slow or badly linked peer can cost its equal share more than it adds), until nothing helps.
    No candidate keeps fewer rollout peers than the job requires (``required_rollouts``).

    R trainers: start from the R peers of the highest measured TFLOPS as trainers (training is the
    compute-bound task) with the rest rolling out, and from the same trainers colocated (no rollout
    peer); then each ``step`` tries every single move from the best so far (a trainer swapped with a
    rollout or idle peer, a rollout peer dropped or an idle one added, every rollout peer dropped)
    and stops when none helps: at most R(n-R) + n - R + 1 evaluations a step. A roster of exactly R
    peers has the colocated plan only.

    The interface is the one ``peerd.jobs.island.IslandThread`` drives (``step``, ``best``,
    ``best_cost``, ``accept``).
    """

    def __init__(
        self,
        model: _Model,
        max_peers: int | None,
        replicas: int = 1,
        required: int = 0,
        counter: _Counter | None = None,
    ) -> None:
        self.model = model
        self.replicas = replicas
        self.required = required
        self.obj = counter or _Counter()
        self.generation = 0
        self._best: tuple[float, Allocation] | None = None
        peers = sorted(model.index)
        self.limit = min(max_peers or len(peers), len(peers))
        if len(peers) == replicas:
            self._consider(tuple(peers), ())
        elif replicas == 1:
            for trainer in peers:
                others = tuple(p for p in peers if p != trainer)[: max(self.limit - 1, 0)]
                if others:
                    self._consider((trainer,), others)
                self._consider((trainer,), ())
        elif len(peers) > replicas and self.limit >= replicas:
            tflops = {d.id: d.tflops for d in model.scenario.devices}
            ranked = sorted(peers, key=lambda p: (-tflops[p], p))
            trainers = tuple(sorted(ranked[:replicas]))
            self._consider(trainers, tuple(ranked[replicas : self.limit]))
            self._consider(trainers, ())
        self._frozen = False

    def _consider(self, trainers: tuple[str, ...], rollouts: tuple[str, ...]) -> float:
        if len(rollouts) < self.required:
            return math.inf
        self.obj.evaluations += 1
        try:
            cost = self.model.predict(trainers, tuple(sorted(rollouts)))
        except ConfigError:
            return math.inf
        alloc = Allocation((trainers,), tuple(sorted(rollouts)))
        if self._best is None or (cost.seconds, alloc.digest()) < (self._best[0], self._best[1].digest()):
            self._best = (cost.seconds, alloc)
        return cost.seconds

    def step(self, generations: int = 1, deadline: float | None = None) -> bool:
        for _ in range(generations):
            self.generation += 1
            if self._best is None or self._frozen:
                return False
            cost, alloc = self._best
            if self.replicas == 1:
                trainer, rollouts = alloc.devices[0], alloc.spares
                if len(rollouts) <= self.required:
                    self._frozen = True
                    return False
                for drop in rollouts:
                    self._consider((trainer,), tuple(p for p in rollouts if p != drop))
            else:
                self._moves(alloc.stages[0], alloc.spares)
            if self._best[0] >= cost:
                self._frozen = True
        return True

    def _moves(self, trainers: tuple[str, ...], rollouts: tuple[str, ...]) -> None:
        """Every single move from (``trainers``, ``rollouts``), the trainers kept sorted."""
        idle = tuple(p for p in sorted(self.model.index) if p not in trainers and p not in rollouts)
        for t in trainers:
            kept = tuple(x for x in trainers if x != t)
            for r in rollouts:
                swapped = tuple(sorted((*kept, r)))
                self._consider(swapped, tuple(sorted((*(x for x in rollouts if x != r), t))))
            for r in idle:
                self._consider(tuple(sorted((*kept, r))), rollouts)
        for r in rollouts:
            self._consider(trainers, tuple(x for x in rollouts if x != r))
        if len(trainers) + len(rollouts) < self.limit:
            for r in idle:
                self._consider(trainers, (*rollouts, r))
        if rollouts:
            self._consider(trainers, ())

    def best(self, k: int = 1) -> list[Allocation]:
        return [self._best[1]] if self._best is not None else []

    def best_cost(self) -> float:
        return self._best[0] if self._best is not None else math.inf

    def accept(self, migrants: Any) -> int:
        """Re-score migrants with this island's number of trainers (as given, in their replica order)."""
        taken = 0
        for trainers, rollouts in _migrant_roles(migrants):
            if len(trainers) != self.replicas:
                continue
            before = self.best_cost()
            if self._consider(trainers, rollouts) < before:
                taken += 1
                self._frozen = False
        return taken


class RoleSearch:
    """A ``RoleIsland`` for each trainer count the job may run (within the roster and ``max_peers``),
    stepped side by side; the best is the cheapest of theirs (ties by digest, as the consensus
    breaks them). With ``parallel.d_dp: auto`` this is how the consensus chooses how many trainers
    an rl job runs: a single trainer feeds on every other peer's rollouts, more trainers split the
    reference and training work but average their gradients every update and each need rollout
    peers of their own; the cost model weighs both on the roster.

    The interface is ``RoleIsland``'s (the one ``peerd.jobs.island.IslandThread`` drives).
    """

    def __init__(
        self, model: _Model, max_peers: int | None, counts: Iterable[int], min_rollouts: int = 0
    ) -> None:
        counts, peers = sorted(counts), len(model.index)
        limit = min(max_peers or peers, peers)
        required = required_rollouts(min_rollouts, peers, max_peers, counts[0])
        self.obj = _Counter()
        self.generation = 0
        self.islands = {
            r: RoleIsland(model, max_peers, r, required, counter=self.obj)
            for r in counts
            if r == counts[0] or r + required <= limit
        }

    def step(self, generations: int = 1, deadline: float | None = None) -> bool:
        self.generation += generations
        stepped = [island.step(generations, deadline) for island in self.islands.values()]
        return any(stepped)

    def _ranked(self) -> list[tuple[float, str, Allocation]]:
        found = [(i.best_cost(), best.digest(), best) for i in self.islands.values() for best in i.best(1)]
        return sorted(found, key=lambda c: c[:2])

    def best(self, k: int = 1) -> list[Allocation]:
        return [alloc for _, _, alloc in self._ranked()[:1]]

    def best_cost(self) -> float:
        ranked = self._ranked()
        return ranked[0][0] if ranked else math.inf

    def accept(self, migrants: Any) -> int:
        """Each migrant goes to the island of its trainer count (one the job may not run is dropped)."""
        by_count: dict[int, list[Allocation]] = {}
        for trainers, rollouts in _migrant_roles(migrants):
            if len(trainers) in self.islands:
                by_count.setdefault(len(trainers), []).append(Allocation((trainers,), rollouts))
        return sum(self.islands[r].accept(found) for r, found in by_count.items())


def _migrant_roles(migrants: Iterable[Any]) -> Iterator[tuple[tuple[str, ...], tuple[str, ...]]]:
    """The (trainers, rollout peers) of each migrant (an ``Allocation`` or its plain form) that is an
    rl job's allocation; others are skipped."""
    for m in migrants:
        try:
            yield roles(m if isinstance(m, Allocation) else Allocation.from_plain(m))
        except ConfigError:
            continue
