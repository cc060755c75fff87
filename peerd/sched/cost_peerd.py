"""The ``peerd`` cost model: seconds per training iteration with compute, memory, micro-batches and compression.

Notation: G = d_pp stages in pipeline order, D = d_dp replicas, M = global_batch /
(D * micro_batch) micro-batches per replica per iteration, L layers, b = micro_batch,
s = seq, h = hidden, p_l = parameters of layer l (mean p̄ used for the split).

- Compute. Forward FLOPs per token of a layer: 2 p_l + 4 s h (matmuls + attention);
  a micro-batch's forward + backward costs ``mult`` forwards (3, or 4 with activation
  recomputation): F = mult * b * s * f̄ per layer per micro-batch. A device d takes
  ``F / (TFLOPS_d * 1e12) + w̄_d`` seconds for it, where ``w̄_d`` prices the mean layer's work beside
  its arithmetic (``ModelShape.layer_work``, counted on the runtime's code): ops x the device's
  seconds per op, traffic / its memory bandwidth, element units x its seconds per unit, each where
  the device measured it (a small model's stage is dispatch- and traffic-bound: 1.9 ms for a
  width-128 block's micro-batch of 2 x 64 tokens on one CPU thread, 0.75 ms by its FLOPs). Its
  rate is F over that; stage k runs at its slowest replica: ``t_k = F / (min rate in group k *
  1e12)`` seconds per layer per micro-batch. CPU devices that share a
  machine (``Device.host``) compute at ``cores / threads`` of their measured rate while the
  layout's tasklets on that machine keep more threads busy than it has cores: in the pipeline's
  steady state every stage computes at once (``peerd.sched.hosts``; spares idle).
- Memory. A device of stage k holding n layers needs ``n * (p̄ * state_bytes +
  inflight_k * b * s * act_mem)`` bytes, ``act_mem`` = 34 h per token per layer (2 h
  with recomputation), ``inflight_k`` = M for GPipe, min(M, G - k) for 1F1B.
  ``cap_k`` = the most layers the smallest device of group k can hold.
- Uneven layers. ``n_k`` minimises max_k n_k t_k subject to 1 <= n_k <= cap_k,
  sum n_k = L (greedy one layer at a time to the stage whose new time is smallest,
  ties to the stage with fewer layers: optimal for this min-max, and an even split
  when compute is free). If no split fits, the layout is infeasible: its total is
  1e9 * (1 + layers left over), so the search still moves towards feasibility.
- Pipeline. Per micro-batch, a boundary between stages costs the bottleneck over the
  matched replica pairs of ``α + 8 a r_f / β`` forward plus ``α + 8 a r_b / β``
  backward (a = b s h activation bytes, or ``c_pp_bytes / M`` when given;
  symmetrised), call it E_e. Stage time T_k = n_k t_k. Once the pipeline is full, a
  boundary holds up each micro-batch for its busier direction's serialisation
  ``S_e = max(8 a r_f / β, 8 a r_b / β')`` (the two directions are two links carrying
  activations and gradients at once, and a link's delay overlaps its next message).
  A hop also waits for its ends' CPU, whatever the link: per micro-batch there and back, a
  message end each side each way (``Device.message_us``: framing, p2pd; ``wire_byte_ns`` per
  payload byte) and, per direction that compresses, an encode at the sender and a decode at
  the receiver (``Device.codec_us`` + values x ``codec_value_ns``), each at the stage's slowest
  member and slowed with its compute on a shared machine: H_e.
  ``pipe = sum_k T_k + sum_e (E_e + H_e) + (M - 1) max(max_k T_k, max_e S_e)`` for both
  schedules (one micro-batch there and back, then the slowest station paces every other one);
  1F1B with M > G also waits a round trip every G micro-batches (stage 0 holds at most G), so
  its pace is at least ``(sum_k T_k + sum_e (E_e + H_e)) / G``.
- Data parallel. Stage k exchanges c_k = sum of p_l over its n_k layers (taken in order)
  * gradient_bytes * r_g bytes, so an embedding or a head weighs what it holds (or c_dp_bytes
  scaled by n_k / (L / G)). The runtime (``peerd.averaging``) sends a member's D - 1 shares of
  c_k / D at once, to every partner, then gets the averaged shares back the same way. Each flow
  runs on its own measured link; where the scenario declares the member's access link u_d
  (``Device.access_mbps``), all its flows share that:
  ``dp_k = max_{d in group k} 2 (max_{d'} α + 8 (c_k / D) max(max_{d'} 1 / β, (D - 1) / u_d))``;
  Each member also encodes, decodes and reduces (``TrainingSpec.averaging_work``, counted on the
  runtime's code): its ops x seconds per op + its bytes / memory bandwidth at the stage's slowest
  member, slowed on a shared machine as the compute, is added to dp_k, and so are its messages'
  ends: 4 (D - 1) of them (shares out and in, then averages), each ``message_us`` and
  ``c_k / D x wire_byte_ns``.
  DP = max_k dp_k (after the pipeline, not overlapped). DT-FM's yardstick sums the D - 1
  exchanges instead, as if each waited for the one before; with D = 2 the two agree.
- Gradient norm (``norm_exchange``: clipping, or fp16's overflow verdict). After the all-reduce
  the stages pass partial sums of squares up the pipeline to stage 0 and the total back down:
  ``norm = 2 sum_e (max_j α_e,j + m_e)``, one small message per boundary each way (the largest
  one-way delay among the boundary's matched pairs; m_e its two ends' CPU, as in H_e).
- Update. Each stage then steps its optimizer over its layers' parameters:
  ``update_k = max_{d in group k} (Σ_l update_ops_l x launch_d + Σ_l update_bytes_l / bandwidth_d)``
  (``ModelShape.layer_work``, counted on the worker's update with its rollback copy; each term at
  the member slowest at it, on a shared machine slowed as the compute), UPDATE = max_k update_k.
- Shared machines' cores. The phases above slow a machine's tasklets while they compute at once;
  its cores also carry work the phases overlap with the links: the daemons' messages (framing,
  p2pd's copies and encryption; ``Device.message_us`` per message end and ``wire_byte_ns`` per
  payload byte end, measured per machine) and their upkeep (``Device.idle_cores``, measured live).
  A member of stage k sends or receives ``2 M`` messages of ``a (r_f + r_b) / 2`` bytes per
  neighbour boundary (2 more with the norm's trip) and ``4 (D - 1)`` shares of ``c_k / D`` per
  iteration, and per micro-batch and boundary one codec call (an encode or a decode of the
  micro-batch's ``b s h`` values; ``Device.codec_us`` + values x ``codec_value_ns``) per direction
  that compresses; with its compute (on
  its threads), its update and its averaging arithmetic, the CPU seconds of the layout's members
  on a machine over the cores its daemons leave idle-free are a floor:
  ``HOST = max_machines sum CPU / (cores - sum idle_cores)``.
- total = max(pipe + DP + norm + UPDATE, HOST) seconds per iteration. Spare devices cost nothing.
- Stage order: open-loop TSP over the E_e (the sum term), then the better of the
  two directions (1F1B memory differs); the max term is not part of the TSP.

Reduction to ``dtfm``: identical devices with free compute, one micro-batch per
tasklet (M = 1), ratios 1, two replicas and the same explicit c_dp/c_pp give T_k = 0, an
even split, pipe = sum_e E_e = 2 PP and dp_k = dtfm's dp: the totals are equal, so the
rankings are too (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from peerd.errors import ConfigError
from peerd.sched.elements import PerFamily
from peerd.sched.hosts import HostLoad
from peerd.sched.objective import Cost, Edge, Objective, edge_culprits
from peerd.sched.problem import Problem, Shape
from peerd.sched.scenario import AveragingWork, LayerWork

INFEASIBLE = 1e9


@dataclass(frozen=True)
class PeerdGroup:
    members: np.ndarray
    memory: float  # smallest member, bytes
    a: np.ndarray  # per member: its all-reduce's latency part (s), ``member_terms``
    b: np.ndarray  # per member: its all-reduce's seconds per byte of the stage's gradients


class LayoutArrays(NamedTuple):
    """What ``batch_cost`` needs about P layouts of G stages with D replicas each."""

    tflops: np.ndarray  # (P, G) slowest device per stage
    memory: np.ndarray  # (P, G) smallest device per stage, bytes
    a: np.ndarray  # (P, G, D) latency part of each member's data-parallel exchange
    b: np.ndarray  # (P, G, D) per-byte part of it
    emax: np.ndarray  # (P, G-1) boundary bottlenecks
    smax: np.ndarray  # (P, G-1) boundary's busiest direction per micro-batch (serialisation, no delay)
    emean: np.ndarray  # (P, G-1) boundary mean pair costs
    hops: np.ndarray  # (P, G-1) boundary's largest one-way delay among its matched pairs
    members: np.ndarray  # (P, G, D) the devices (indices) of each stage


class HostRates(NamedTuple):
    """(P, G) each: a stage's CPU seconds per unit at its slowest member, as its machine runs them."""

    op_s: np.ndarray  # per op (its update, its averaging arithmetic)
    byte_s: np.ndarray  # per byte of memory traffic
    end_s: np.ndarray  # per message end (framing, p2pd)
    wire_s: np.ndarray  # per payload byte of a message end
    call_s: np.ndarray  # per codec call (a micro-batch's encode or decode)


class BatchDetail(NamedTuple):
    """``batch_cost``'s totals with the pieces they are made of."""

    total: np.ndarray  # (P,) seconds per iteration
    soft: np.ndarray  # (P,) tie-break
    n: np.ndarray  # (P, G) layers per stage
    dp: np.ndarray  # (P, G) data-parallel seconds per stage
    pipe: np.ndarray  # (P,) pipelined forward/backward seconds
    stage: np.ndarray  # (P, G) compute seconds per stage per micro-batch
    norm: np.ndarray  # (P,) the gradient norm's trip along the pipeline and back
    update: np.ndarray  # (P,) the slowest stage's optimizer step
    host: np.ndarray  # (P,) the busiest shared machine's CPU seconds over its cores (a floor of total)
    hop_cpu: np.ndarray  # (P, G-1) each boundary's message and codec CPU per micro-batch there and back


class PeerdObjective(Objective):
    """Iteration time with compute, memory, uneven layers, micro-batch pipelining, compression."""

    name = "peerd"
    orientation_matters = True  # 1F1B memory depends on the stage position

    def __init__(self, problem: Problem, shape: Shape) -> None:
        sc = problem.scenario
        if sc.model is None:
            raise ConfigError("model", "is required by the peerd objective (layers, hidden, seq)")
        if sc.training is None:
            raise ConfigError("training", "is required by the peerd objective")
        model, tr = sc.model, sc.training
        for i, dev in enumerate(sc.devices):
            for key in ("tflops", "memory_gb"):
                if getattr(dev, key) <= 0:
                    raise ConfigError(f"devices[{i}].{key}", "must be > 0 for the peerd objective")
        if tr.global_batch % (shape.d_dp * tr.micro_batch):
            raise ConfigError(
                "training.global_batch",
                f"{tr.global_batch} sequences do not split into {shape.d_dp} replicas x micro-batches of {tr.micro_batch}",
            )
        if shape.d_pp > model.layers:
            raise ConfigError("training.d_pp", f"{shape.d_pp} stages for {model.layers} layers")
        self.layers = model.layers
        self.micro_batches = tr.global_batch // (shape.d_dp * tr.micro_batch)
        params = model.per_layer_params()
        tokens = tr.micro_batch * model.seq
        fwd = tokens * (2.0 * params + 4.0 * model.seq * model.hidden)  # FLOPs per layer per micro-batch
        self.layer_flops = (4.0 if tr.recompute else 3.0) * float(fwd.mean())
        act = tr.activation_memory_per_token_layer
        if act is None:
            act = (2.0 if tr.recompute else 34.0) * model.hidden
        self.layer_static = float(params.mean()) * tr.state_bytes_per_param
        self.layer_act = tokens * act
        g = np.arange(shape.d_pp)
        self.inflight = (
            np.full(shape.d_pp, self.micro_batches)
            if tr.schedule == "gpipe"
            else np.minimum(self.micro_batches, shape.d_pp - g)
        ).astype(float)
        if tr.c_dp_bytes is not None:
            grads = np.full(model.layers, tr.c_dp_bytes / (model.layers / shape.d_pp))
        else:
            grads = params.astype(float) * tr.gradient_bytes
        grads = grads * tr.gradient_ratio
        self.layer_grad = float(grads.mean())
        # gradient bytes of layers [0, i): a stage's exchange carries its own layers' parameters
        # (an embedding or a head is not a mean layer), whatever the split assumed
        self.grad_prefix = np.concatenate([[0.0], np.cumsum(grads)])
        self.c_act = (
            tr.c_pp_bytes / self.micro_batches
            if tr.c_pp_bytes is not None
            else tokens * model.hidden * tr.activation_bytes
        )
        self.ratios = (tr.forward_ratio, tr.backward_ratio)
        need = self.layer_static + self.layer_act  # one layer, one micro-batch in flight
        if need > problem.memory_bytes.max():
            raise ConfigError(
                "model",
                f"one layer needs {need / 1e9:.2f} GB (weights + optimizer state + activations) "
                f"but the largest device has {problem.memory_bytes.max() / 1e9:.2f} GB",
            )
        a2 = 2.0 * problem.delay
        bi = 16.0 / (shape.d_dp * problem.bandwidth)
        np.fill_diagonal(a2, 0.0)
        np.fill_diagonal(bi, 0.0)
        self.a2, self.bi = a2, bi
        # a declared access link carries all of a device's flows; without one, each flow its own link
        self.uplink_bi = 16.0 / (shape.d_dp * problem.access_bps)
        self.norm_exchange = tr.norm_exchange
        self.hop = (problem.delay + problem.delay.T) / 2.0  # one small message either way
        np.fill_diagonal(self.hop, 0.0)
        super().__init__(problem, shape)
        self.station = self._station()
        self.cycle_bound = tr.schedule != "gpipe" and self.micro_batches > shape.d_pp
        # a device's seconds per op and per byte beside the matmuls: 0 where it measured none
        self.op_s = np.array([d.launch_us * 1e-6 if d.launch_us else 0.0 for d in problem.devices])
        self.byte_s = np.array(
            [1e-9 / d.memory_bandwidth_gb_s if d.memory_bandwidth_gb_s else 0.0 for d in problem.devices]
        )
        # its machine's CPU per message end and payload byte end: 0 where not measured (or no host)
        self.message_s = np.array([(d.message_us or 0.0) * 1e-6 for d in problem.devices])
        self.wire_byte_s = np.array([(d.wire_byte_ns or 0.0) * 1e-9 for d in problem.devices])
        # and per compressing codec call: per micro-batch, each boundary direction that compresses
        # is one encode and one decode (one call each end) of the micro-batch's activation values
        codec_s = np.array([(d.codec_us or 0.0) * 1e-6 for d in problem.devices])
        codec_value_s = np.array([(d.codec_value_ns or 0.0) * 1e-9 for d in problem.devices])
        self.call_s = codec_s + tokens * model.hidden * codec_value_s  # one call, per device
        self.codec_calls = float(sum(r < 1.0 for r in self.ratios))  # per member, boundary, micro-batch
        self.hop_bytes = self.c_act * sum(self.ratios)  # a micro-batch's activation and gradient on the wire
        self.boundaries = (g > 0).astype(float) + (g < shape.d_pp - 1)  # neighbours per stage position
        self.threads = np.array([d.host.threads if d.host is not None else 1 for d in problem.devices])
        work = model.layer_work or [LayerWork()] * model.layers
        self.speed = self._rates(problem, work)
        self.update_ops_prefix = np.concatenate([[0.0], np.cumsum([w.update_ops for w in work])])
        self.update_bytes_prefix = np.concatenate([[0.0], np.cumsum([w.update_traffic_bytes for w in work])])
        average_ops, bytes_per_value = (tr.averaging_work or AveragingWork()).at(shape.d_dp)
        self.average_ops = average_ops
        self.average_bytes_prefix = np.concatenate([[0.0], np.cumsum(params.astype(float))]) * bytes_per_value
        self.host_load = HostLoad.of(problem.hosts, [d.idle_cores or 0.0 for d in problem.devices])
        # What a device adds to an even stage's data-parallel exchange.
        self.affinity = a2 + self.layer_grad * (model.layers / shape.d_pp) * bi

    def _rates(self, problem: Problem, work: list[LayerWork]) -> np.ndarray:
        """(N,) each device's TFLOPS on the mean layer's micro-batch, its work beside the FLOPs included."""
        units = PerFamily(*np.mean([w.elements.values() for w in work], axis=0))
        seconds = (
            self.layer_flops / (problem.tflops * 1e12)
            + float(np.mean([w.ops for w in work])) * self.op_s
            + float(np.mean([w.traffic_bytes for w in work])) * self.byte_s
            + np.array(
                [units.seconds(d.element_ns) if d.element_ns is not None else 0.0 for d in problem.devices]
            )
        )
        return self.layer_flops / seconds / 1e12

    def _pair_cost(self) -> np.ndarray:
        p = self.problem
        fwd_s, bwd_s = self._serialisation()
        pc = p.delay + fwd_s + p.delay.T + bwd_s  # d -> d', then the gradients come back d' -> d
        pc = (pc + pc.T) / 2.0
        np.fill_diagonal(pc, 0.0)
        return pc

    def _station(self) -> np.ndarray:
        """(N, N) what a boundary between d and d' holds up each micro-batch once the pipeline is
        full: its busier direction's serialisation. Each direction is its own link (activations
        one way, gradients the other, at once) and a link's delay overlaps the next message."""
        st = np.maximum(*self._serialisation())
        st = (st + st.T) / 2.0
        np.fill_diagonal(st, 0.0)
        return st

    def _serialisation(self) -> tuple[np.ndarray, np.ndarray]:
        """(N, N) x 2: seconds to put one micro-batch's activations on d -> d' and its gradients on d' -> d."""
        p = self.problem
        rf, rb = self.ratios
        return 8.0 * self.c_act * rf / p.bandwidth, 8.0 * self.c_act * rb / p.bandwidth.T

    def _group(self, members: np.ndarray) -> PeerdGroup:
        a, b = self.member_terms(members)
        return PeerdGroup(members, float(self.problem.memory_bytes[members].min()), a, b)

    def member_terms(self, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each member's all-reduce as ``a + bytes * b`` for groups ``members`` (..., D) of device
        indices: ``a`` twice its largest one-way delay to the others, ``b`` the seconds per byte of
        its slowest partner's link or of its declared access link carrying all D - 1 shares, the
        larger."""
        pairs = (members[..., :, None], members[..., None, :])
        a = self.a2[pairs].max(axis=-1)
        uplink = (members.shape[-1] - 1) * self.uplink_bi[members]
        return a, np.maximum(self.bi[pairs].max(axis=-1), uplink)

    def busy_tflops(self, members: np.ndarray) -> np.ndarray:
        """(P, G, D) each member's TFLOPS while every tasklet of its layout computes (``members``
        (P, G, D) device indices): its measured rate, divided on a machine whose cores the layout's
        CPU devices oversubscribe (``peerd.sched.hosts``; spares idle)."""
        return self.speed[members] / self.host_factors(members)

    def host_factors(self, members: np.ndarray) -> np.ndarray:
        """(P, G, D) how much each member's compute slows while every tasklet of its layout computes."""
        if self.host_load is None:
            return np.ones(members.shape)
        flat = members.reshape(len(members), -1)
        return self.host_load.factors(flat).reshape(members.shape)

    def host_rates(self, members: np.ndarray) -> HostRates:
        """Each stage's host rates at its slowest member, slowed where the layout oversubscribes its
        machine (what its update, its averaging arithmetic and its messages run at)."""
        slow = self.host_factors(members)

        def slowest(rate: np.ndarray) -> np.ndarray:
            return (rate[members] * slow).max(axis=2)

        return HostRates(
            slowest(self.op_s),
            slowest(self.byte_s),
            slowest(self.message_s),
            slowest(self.wire_byte_s),
            slowest(self.call_s),
        )

    def stage_tflops(self, members: np.ndarray) -> np.ndarray:
        """(P, G) the slowest member's TFLOPS per stage (``busy_tflops``): what paces the stage."""
        return self.busy_tflops(members).min(axis=2)

    # --- the batched core: every cost goes through here ----------------------------------
    def batch_cost(self, x: LayoutArrays) -> tuple[np.ndarray, np.ndarray]:
        """Totals and softs (P,) for P layouts."""
        d = self.batch_detail(x)
        return d.total, d.soft

    def batch_detail(self, x: LayoutArrays) -> BatchDetail:
        """Totals, softs and their parts for P layouts."""
        tflops, memory, a, b, emax, smax, emean, hops, members = x
        cpu = self.host_rates(members)
        n_layers, g = self.layers, tflops.shape[1]
        t = self.layer_flops / (tflops * 1e12)  # (P, G) s per layer per micro-batch
        per_layer_mem = self.layer_static + self.inflight[None, :g] * self.layer_act
        cap = np.floor(memory / per_layer_mem).astype(np.int64)
        n, short = split_layers(t, np.minimum(cap, n_layers - g + 1), n_layers)
        stage = n * t  # (P, G)
        c = self.stage_grad_bytes(n)  # (P, G)
        # a member's host work beside its layers (P, G): its update, its averaging arithmetic
        update_ops = self.stage_sum(self.update_ops_prefix, n)
        update_bytes = self.stage_sum(self.update_bytes_prefix, n)
        average_bytes = self.stage_sum(self.average_bytes_prefix, n)
        arithmetic = self.average_ops * cpu.op_s + average_bytes * cpu.byte_s
        # and its messages' ends: D - 1 shares out and in, then as many averages (none alone)
        d = self.shape.d_dp
        messages = 4.0 * (d - 1) * cpu.end_s + 4.0 * (d - 1) / d * c * cpu.wire_s
        dp = (a + c[..., None] * b).max(axis=2) + arithmetic + messages  # (P, G)
        # a hop's own CPU, on the path whatever the link: a message end each side (framing, p2pd),
        # and each direction that compresses an encode at the sender and a decode at the receiver
        ends = cpu.end_s[:, :-1] + cpu.end_s[:, 1:]  # (P, G-1) one message over each boundary
        payload = self.hop_bytes * (cpu.wire_s[:, :-1] + cpu.wire_s[:, 1:])
        hop_cpu = 2.0 * ends + payload + self.codec_calls * (cpu.call_s[:, :-1] + cpu.call_s[:, 1:])
        fill = stage.sum(axis=1) + emax.sum(axis=1) + hop_cpu.sum(axis=1)  # one micro-batch there and back
        bubble = stage.max(axis=1)
        if g > 1:
            bubble = np.maximum(bubble, smax.max(axis=1))
        if self.cycle_bound:  # 1F1B: stage 0 sends micro-batch i + G only once i's gradient is back
            bubble = np.maximum(bubble, fill / g)
        pipe = fill + (self.micro_batches - 1) * bubble
        norm = 2.0 * (hops + ends).sum(axis=1) if self.norm_exchange else np.zeros(len(pipe))
        update = (update_ops * cpu.op_s + update_bytes * cpu.byte_s).max(axis=1)
        host = self.host_floor(members, n, c, update_ops + self.average_ops, update_bytes + average_bytes)
        total = np.maximum(pipe + dp.max(axis=1) + norm + update, host)
        total = np.where(short > 0, INFEASIBLE * (1.0 + short), total)
        soft = dp.mean(axis=1) + emean.sum(axis=1) + stage.mean(axis=1)
        return BatchDetail(total, soft, n, dp, pipe, stage, norm, update, host, hop_cpu)

    def host_floor(
        self, members: np.ndarray, n: np.ndarray, c: np.ndarray, ops: np.ndarray, traffic: np.ndarray
    ) -> np.ndarray:
        """(P,) the least time the busiest shared machine needs per iteration: the CPU seconds of its
        devices' work (compute on their threads; update, averaging arithmetic and messages on one)
        over its cores; 0 where no device declares a machine. ``members`` (P, G, D); per stage
        (P, G): layers ``n``, gradient bytes ``c``, a member's ops and bytes beside its layers."""
        if self.host_load is None:
            return np.zeros(len(members))
        g = members.shape[1]
        layers = (self.micro_batches * n)[..., None]  # (P, G, 1) layer passes per member
        compute = layers * self.layer_flops / (self.speed[members] * 1e12) * self.threads[members]
        # per micro-batch, each neighbour boundary: an activation and a gradient, each sent or received;
        # per iteration, 2 (D - 1) shares out (parts, then averages) and as many in, and with the
        # norm's trip a partial sum up and the total down each boundary
        d = self.shape.d_dp
        trips = self.micro_batches + (1.0 if self.norm_exchange else 0.0)
        ends = trips * 2.0 * self.boundaries[:g] + 4.0 * (d - 1)
        payload = self.micro_batches * self.boundaries[:g] * self.hop_bytes + 4.0 * (d - 1) / d * c
        calls = self.micro_batches * self.boundaries[:g] * self.codec_calls  # (G,) per member
        cpu = (
            compute
            + ops[..., None] * self.op_s[members]
            + traffic[..., None] * self.byte_s[members]
            + ends[None, :, None] * self.message_s[members]
            + payload[..., None] * self.wire_byte_s[members]
            + calls[None, :, None] * self.call_s[members]
        )
        flat = members.reshape(len(members), -1)
        return self.host_load.busiest(flat, cpu.reshape(flat.shape))

    def stage_grad_bytes(self, n: np.ndarray) -> np.ndarray:
        """(P, G) gradient bytes each stage exchanges, for layers per stage ``n`` taken in order."""
        return self.stage_sum(self.grad_prefix, n)

    @staticmethod
    def stage_sum(prefix: np.ndarray, n: np.ndarray) -> np.ndarray:
        """(P, G) each stage's sum of a per-layer quantity (``prefix``: its sums over layers [0, i)),
        for layers per stage ``n`` taken in order."""
        ends = np.cumsum(n, axis=-1)  # split_layers never places more than the model's layers
        return prefix[ends] - prefix[ends - n]

    def _arrays(self, groups: list[PeerdGroup], edges: list[Edge]) -> LayoutArrays:
        members = np.stack([x.members for x in groups])[None]
        tflops = self.stage_tflops(members)
        memory = np.array([[x.memory for x in groups]])
        a = np.stack([x.a for x in groups])[None]
        b = np.stack([x.b for x in groups])[None]
        emax = np.array([[e.value for e in edges]]).reshape(1, len(edges))
        emean = np.array([[e.mean for e in edges]]).reshape(1, len(edges))
        matched = [
            (up.members, down.members[list(e.perm)])
            for up, down, e in zip(groups[:-1], groups[1:], edges, strict=True)
        ]
        smax = np.array([[self.station[u, d].max() for u, d in matched]]).reshape(1, len(edges))
        hops = np.array([[self.hop[u, d].max() for u, d in matched]]).reshape(1, len(edges))
        return LayoutArrays(tflops, memory, a, b, emax, smax, emean, hops, members)

    def combine(self, groups: list[PeerdGroup], edges: list[Edge], spares: np.ndarray) -> Cost:
        total, soft, _n, dp, pipe, stage, norm, update, host, hop_cpu = self.batch_detail(
            self._arrays(groups, edges)
        )
        # total = dp + pp + norm + update (pp is the whole pipelined forward/backward, compute
        # included), or host_cpu where the busiest shared machine's cores take longer than that.
        parts = {
            "dp": float(dp[0].max()),
            "pp": float(pipe[0]),
            "norm": float(norm[0]),
            "update": float(update[0]),
            "host_cpu": float(host[0]),
            "compute_per_micro_batch": float(stage[0].sum()),
            "links_per_micro_batch": float(sum(e.value for e in edges)),
            "hop_cpu_per_micro_batch": float(hop_cpu[0].sum()),
            "micro_batches": float(self.micro_batches),
        }
        return Cost(float(total[0]), float(soft[0]), parts)

    def layer_split(self, groups: list[PeerdGroup], edges: list[Edge]) -> tuple[int, ...] | None:
        n = self.batch_detail(self._arrays(groups, edges)).n
        return tuple(int(x) for x in n[0])

    def critical(self, groups: list[PeerdGroup], edges: list[Edge]) -> list[int]:
        total, _, n, dp, _, stage, *_ = self.batch_detail(self._arrays(groups, edges))
        out: list[int] = []
        top = dp[0].max()
        grad_bytes = self.stage_grad_bytes(n)[0]
        members = np.stack([x.members for x in groups])
        rates = self.busy_tflops(members[None])[0]
        for k, grp in enumerate(groups):
            tfl = rates[k]
            if stage[0, k] >= stage[0].max() - 1e-12 or total[0] >= INFEASIBLE:
                out.extend(int(d) for d in grp.members[tfl <= tfl.min()])
            if total[0] >= INFEASIBLE:
                mem = self.problem.memory_bytes[grp.members]
                out.extend(int(d) for d in grp.members[mem <= mem.min()])
            if dp[0, k] >= top - 1e-12:
                vals = grp.a + grad_bytes[k] * grp.b
                out.extend(int(d) for d in grp.members[vals >= vals.max() - 1e-12])
        out += edge_culprits([g.members for g in groups], edges)
        return list(dict.fromkeys(out))

    # --- vectorised grid moves ------------------------------------------------------------
    def swap_scores(
        self, grid: np.ndarray, spares: np.ndarray, upos: np.ndarray, cand: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(total, soft) after swapping cell ``upos[p]`` with position ``cand[p]`` (a cell or a spare)."""
        n_pp, n_dp = grid.shape
        cells = grid.size
        npairs = len(upos)
        p_idx = np.arange(npairs)
        mem = self.problem.memory_bytes
        rk, ck = np.divmod(upos, n_dp)
        u = grid[rk, ck]
        is_spare = cand >= cells
        cc = np.where(is_spare, 0, cand)
        rl, cl = np.divmod(cc, n_dp)
        rl = np.where(is_spare, -1, rl)
        v = np.where(
            is_spare,
            spares[np.clip(cand - cells, 0, max(len(spares) - 1, 0))] if len(spares) else 0,
            grid[rl, cl],
        )
        members = np.broadcast_to(grid, (npairs, n_pp, n_dp)).copy()
        members[p_idx, rk, ck] = v
        swapped = p_idx[~is_spare]
        members[swapped, rl[~is_spare], cl[~is_spare]] = u[~is_spare]
        a, b = self.member_terms(members)
        tflops = self.stage_tflops(members)
        memory = mem[members].min(axis=2)
        if n_pp > 1:
            pmat = self.pair_cost[members[:, :-1], members[:, 1:]]  # (P, G-1, D)
            emax, emean = pmat.max(axis=2), pmat.mean(axis=2)
            smax = self.station[members[:, :-1], members[:, 1:]].max(axis=2)
            hops = self.hop[members[:, :-1], members[:, 1:]].max(axis=2)
        else:
            emax = smax = emean = hops = np.zeros((npairs, 0))
        return self.batch_cost(LayoutArrays(tflops, memory, a, b, emax, smax, emean, hops, members))


def split_layers(t: np.ndarray, cap: np.ndarray, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """Layers per stage minimising the slowest stage, for P layouts at once.

    ``t`` (P, G) seconds per layer, ``cap`` (P, G) most layers each stage can hold.
    Returns n (P, G) and the number of layers that did not fit (P,), 0 when feasible.
    """
    npairs, g = t.shape
    n = np.ones((npairs, g), dtype=np.int64)
    short = np.where((cap < 1).any(axis=1), n_layers, 0)
    rows = np.arange(npairs)
    for _ in range(n_layers - g):
        room = n < cap
        key = np.where(room, (n + 1) * t, np.inf)
        best = key.min(axis=1, keepdims=True)
        tie = room & (key <= best * (1.0 + 1e-12))
        k = np.where(tie, n, np.iinfo(np.int64).max).argmin(axis=1)  # fewest layers, then lowest index
        placed = np.isfinite(best[:, 0])
        n[rows[placed], k[placed]] += 1
        short = short + ~placed
    return n, short
