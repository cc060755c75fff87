"""The job's shared cost model over a consensus roster: roster entries + job spec -> scheduler scenario -> cost.

Every peer of a job scores candidates with this one function, so it must be a pure
function of (roster, allocation, spec): no local measurements, no clock. Links come from
the roster entries only; a pair measured in one direction is assumed symmetric, a pair
measured in neither is estimated through the best two-hop relay (``Scenario``'s
``estimate_missing``), and a pair with no relay either gets a pessimistic default, so a
sparse link matrix never makes a roster unplannable. Scenarios and objectives are cached
by roster digest: re-scoring a candidate costs one evaluation.

Memory: a roster entry's device memory is what its peer measured free when it applied
(``peerd.jobs.service.roster_profile``: the live free memory of its profile, else the total).
Under the ``peerd`` objective an allocation that gives some stage more layers than its
smallest member's memory holds (weights, optimizer state and in-flight activations) is no
candidate at all: scoring refuses it, so no peer proposes, votes for or commits it, and a job
whose roster cannot hold it keeps planning until peers with the memory join. (The ``dtfm``
objective, the DT-FM yardstick, models no memory.)

Machines: a CPU device's entry says which machine it computes on, with how many cores and
threads (``host_share``). Under the ``peerd`` objective the tasklets of one machine slow each
other's compute while they keep more threads busy than it has cores (``peerd.sched.hosts``), and
a layout's compute and messages (each at what its peer measured a message and a byte to cost,
``messaging``) cannot take less than their CPU time over the machine's cores.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from peerd.averaging.work import count_member_work
from peerd.errors import ConfigError
from peerd.jobs.optimizer import optimizer_config
from peerd.jobs.regime import activation_regime
from peerd.jobs.spec import JobSpec
from peerd.pipeline.launches import count_layer_work
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.messages import Roster, RosterDevice
from peerd.sched.cost_peerd import INFEASIBLE
from peerd.sched.elements import PerFamily
from peerd.sched.evolution import Island, SearchConfig
from peerd.sched.hosts import HostShare
from peerd.sched.layout import score_allocation
from peerd.sched.objective import Cost, Objective
from peerd.sched.planner import make_island, make_objective
from peerd.sched.problem import Problem, Shape, candidate_shapes
from peerd.sched.scenario import Device, Link, ModelShape, Scenario, TrainingSpec

# A pair nobody measured, not even through a relay: assume a slow consumer link.
UNKNOWN_DELAY_MS = 250.0
UNKNOWN_BANDWIDTH_MBPS = 10.0
MIN_TFLOPS = 1e-6  # a profile without a measurement still scores (badly), instead of breaking the roster
CACHE_ROSTERS = 64


@dataclass(frozen=True)
class JobModel:
    """What the scheduler needs from a job spec: objective name, model sizes, training setup."""

    objective: str
    model: ModelShape
    training: TrainingSpec
    single_stage: bool = False
    """The model ties its embedding and head weights, which the pipeline cannot split: d_pp = 1."""


def _ratio(bits: int | None) -> float:
    """Wire bytes relative to raw fp32 (what the pipeline sends uncompressed)."""
    return 1.0 if bits is None else bits / 32.0


def state_bytes_per_param(spec: JobSpec) -> float:
    """Device bytes a tasklet holds per parameter: fp32 master weights and gradients (whatever the
    compute precision) plus the optimizer's fp32 state: Adam/AdamW's two moments, SGD's momentum
    buffer when it has momentum. (Error-feedback residuals and rollback copies live in host memory.)"""
    opt = spec.optimizer
    moments = 2 if opt.name in ("adam", "adamw") else int(bool(opt.momentum))
    return 4.0 * (2 + moments)


def job_model(spec: JobSpec) -> JobModel:
    """The scheduler's view of ``spec`` (any model family of ``peerd.models.registry``)."""
    family = spec.model.family()
    if family.tied and spec.parallel.d_pp not in ("auto", 1):
        untie = "model.hf.tie_word_embeddings" if spec.model.hf is not None else "model.overrides.tie_weights"
        raise ConfigError(
            "parallel.d_pp",
            f"the model ties its embedding and head weights, which cannot be split over "
            f"{spec.parallel.d_pp} stages; set {untie}: false or d_pp: 1",
        )
    costs = family.layer_costs(spec.data.seq_len)
    work = (
        count_layer_work(family, spec.micro_batch, spec.data.seq_len, optimizer_config(spec.optimizer))
        if spec.kind != "rl" and spec.planning.objective == "peerd"
        else None
    )
    comp = spec.compression
    forward_bits = None if comp.forward == "none" else comp.forward_bits
    regime = activation_regime(spec, family.hidden)  # AC-SGD: what the visits per example let it send
    averaging = (
        count_member_work(
            None if comp.gradient_bits is None else f"q{comp.gradient_bits}", spec.averaging.aggregator
        )
        if work is not None
        else None
    )
    model = ModelShape(
        layers=family.num_layers,  # the splittable units: embedding + blocks + head
        hidden=family.hidden,
        seq=spec.data.seq_len,
        layer_params=[float(max(c.params, 1)) for c in costs],
        layer_work=work,
        name=spec.model.preset or family.name,
    )
    training = TrainingSpec(
        global_batch=spec.global_batch,
        micro_batch=spec.micro_batch,
        d_pp=spec.parallel.d_pp,
        d_dp=spec.parallel.d_dp,
        forward_ratio=regime.forward_ratio if regime is not None else _ratio(forward_bits),
        backward_ratio=_ratio(comp.backward_bits),
        gradient_ratio=_ratio(comp.gradient_bits),
        # what peerd.pipeline.worker does: clipping needs the replica's norm; fp16 sends its overflows
        norm_exchange=spec.optimizer.grad_clip is not None or spec.precision == "fp16",
        activation_bytes=4,  # fp32 on the wire before compression
        gradient_bytes=4,
        state_bytes_per_param=state_bytes_per_param(spec),
        averaging_work=averaging,
    )
    return JobModel(spec.planning.objective, model, training, single_stage=family.tied)


def job_shapes(scenario: Scenario, jm: JobModel) -> list[Shape]:
    """The shapes the job's tasklets can run on this roster; the planner proposes and accepts no other.

    A roster larger than the shape leaves spares (``peerd`` objective; ``dtfm`` uses every
    peer). Each replica runs ``global_batch / d_dp`` examples as whole micro-batches, so any
    width proposed keeps the global batch. A model with tied weights runs as one stage.
    """
    shapes = candidate_shapes(scenario, allow_spares=jm.objective == "peerd", whole_micro_batches=True)
    if jm.single_stage:
        shapes = [s for s in shapes if s.d_pp == 1]
        if not shapes:
            raise ConfigError("parallel.d_pp", "a model with tied weights runs as one stage: no shape fits")
    return shapes


def host_share(device: RosterDevice) -> HostShare | None:
    """The machine a roster entry's CPU device shares, or None (an accelerator, an older peer)."""
    if device.host is None or device.host_cores is None or device.threads is None:
        return None
    return HostShare(device.host, device.host_cores, device.threads)


def element_ns(device: RosterDevice) -> PerFamily | None:
    """A roster entry's element costs (seconds per unit) as the cost models read them (ns), or None."""
    costs = device.element_s
    if costs is None:
        return None
    return PerFamily(*(1e9 * getattr(costs, f.name) for f in dataclasses.fields(PerFamily)))


def messaging(device: RosterDevice) -> dict[str, float]:
    """A roster entry's messaging costs (µs, ns) and idle cores as ``Device`` fields, where it declares
    them and the machine they are spent on (a CPU device's host); none otherwise."""
    if host_share(device) is None:
        return {}
    out = {"idle_cores": device.idle_cores} if device.idle_cores is not None else {}
    if device.message_s is not None and device.wire_byte_s is not None:
        out |= {"message_us": device.message_s * 1e6, "wire_byte_ns": device.wire_byte_s * 1e9}
    if device.codec_s is not None and device.codec_value_s is not None:
        out |= {"codec_us": device.codec_s * 1e6, "codec_value_ns": device.codec_value_s * 1e9}
    return out


def roster_scenario(roster: Roster, jm: JobModel) -> Scenario:
    """The scenario of one roster view: a device per entry, links as measured (see the module docstring)."""
    peers = set(roster.peers)
    measured: dict[tuple[str, str], tuple[float, float]] = {}
    for entry in roster.entries:
        for link in entry.links:
            if link.peer in peers and link.peer != entry.peer:
                measured[entry.peer, link.peer] = (link.delay_s * 1e3, link.bandwidth_bps / 1e6)
    for (a, b), value in list(measured.items()):
        measured.setdefault((b, a), value)  # symmetric unless the other side measured too
    devices = [
        Device(
            id=e.peer,
            region=e.profile.region,
            tflops=max(float(e.profile.tflops), MIN_TFLOPS),
            memory_gb=max(e.profile.memory_bytes, 1) / 1e9,
            memory_bandwidth_gb_s=(
                e.profile.memory_bandwidth / 1e9 if e.profile.memory_bandwidth is not None else None
            ),
            launch_us=e.profile.launch_s * 1e6 if e.profile.launch_s is not None else None,
            element_ns=element_ns(e.profile),
            host=host_share(e.profile),
            **messaging(e.profile),
        )
        for e in roster.entries
    ]
    links = [Link(a, b, delay_ms=d, bandwidth_mbps=bw) for (a, b), (d, bw) in sorted(measured.items())]
    scenario = Scenario(
        devices=devices, links=links, estimate_missing=True, model=jm.model, training=jm.training
    )
    delay, bw = scenario.delay_matrix(), scenario.bandwidth_matrix()
    holes = np.argwhere(np.isnan(delay) | np.isnan(bw))
    if len(holes):
        ids = scenario.device_ids
        links += [
            Link(ids[i], ids[j], delay_ms=UNKNOWN_DELAY_MS, bandwidth_mbps=UNKNOWN_BANDWIDTH_MBPS)
            for i, j in holes
        ]
        scenario = Scenario(devices=devices, links=links, model=jm.model, training=jm.training)
    return scenario


class RosterScorer:
    """``score(roster, allocation) -> seconds per iteration`` under the job's objective, cached per roster."""

    def __init__(self, spec: JobSpec) -> None:
        self.jm = job_model(spec)
        self._scenarios: OrderedDict[bytes, Scenario] = OrderedDict()
        self._objectives: dict[tuple[bytes, Shape], Objective] = {}
        self.evaluations = 0

    def scenario(self, roster: Roster) -> Scenario:
        key = roster.digest
        found = self._scenarios.get(key)
        if found is None:
            found = self._scenarios[key] = roster_scenario(roster, self.jm)
            while len(self._scenarios) > CACHE_ROSTERS:
                old, _ = self._scenarios.popitem(last=False)
                self._objectives = {k: v for k, v in self._objectives.items() if k[0] != old}
        return found

    def __call__(self, roster: Roster, allocation: Allocation) -> float:
        """The cost of ``allocation`` exactly as written; ConfigError if it does not fit the roster or the job."""
        return self.cost(roster, allocation).total

    def cost(self, roster: Roster, allocation: Allocation) -> Cost:
        """``allocation``'s seconds per iteration with the parts the objective adds up (``Cost.parts``)."""
        scenario = self.scenario(roster)
        shape = Shape(allocation.d_pp, allocation.d_dp)
        key = (roster.digest, shape)
        obj = self._objectives.get(key)
        if obj is None:
            if shape not in job_shapes(scenario, self.jm):
                raise ConfigError("stages", f"shape {shape} is not allowed for this roster and job")
            obj = self._objectives[key] = make_objective(Problem(scenario), shape, self.jm.objective)
        self.evaluations += 1
        cost = score_allocation(obj, allocation)
        total = float(cost.total)
        if not math.isfinite(total):
            raise ConfigError("allocation", "scored as infinite")
        if total >= INFEASIBLE:  # cost_peerd: INFEASIBLE x (1 + layers no stage's memory could take)
            short = round(total / INFEASIBLE - 1)
            raise ConfigError(
                "allocation",
                f"does not fit the peers' free memory: {short} layer(s) fit on no stage of {allocation.stages}",
            )
        return cost

    def island(
        self, scenario: Scenario, seed: int, time_budget: float, config: SearchConfig | None = None
    ) -> Island:
        """A search island on a roster's ``scenario`` (the scheduler picks the shape when it is ``auto``).

        Safe to call from the island's thread: it only reads ``scenario`` (built by ``scenario()``).
        """
        return make_island(
            scenario,
            self.jm.objective,
            seed=seed,
            shapes=job_shapes(scenario, self.jm),
            config=config,
            time_budget=max(time_budget, 0.1),
        )
