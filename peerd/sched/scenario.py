"""The scenario data model: these devices, these links, this model and training setup.

One typed description shared by the scheduler, the link shaper and (later) the
daemon, which builds the same object from DHT records. YAML/JSON shape::

    name: two-regions
    description: free text
    regions:                      # optional: region-level matrices, indexed like ``names``
      names: [ohio, virginia]
      delay_ms: [[1, 11], [11, 1]]            # ONE-WAY delay; null = not measured
      bandwidth_mbps: [[5000, 1120], [1120, 5000]]
    devices:
      - {id: a, region: ohio, tflops: 125, memory_gb: 16}
      - {id: b, region: virginia, tflops: 125, memory_gb: 16, access_mbps: 1000}
      - {id: c, region: ohio, tflops: 312, memory_gb: 80, memory_bandwidth_gb_s: 2039}
    links:                        # optional: device-level, directional, override regions
      - {src: a, dst: b, delay_ms: 12.5, bandwidth_mbps: 900}
    estimate_missing: false       # true: fill unmeasured pairs from two-hop relay paths
    model: {...}                  # optional, see ModelShape
    training: {...}               # optional, see TrainingSpec

Resolution of a directional pair (src, dst): a device-level link first; then the
region matrix (bandwidth capped by both devices' ``access_mbps``); then, when
``estimate_missing`` is set, the best two-hop relay estimate; else ``ConfigError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np

from peerd import loading
from peerd.errors import ConfigError
from peerd.loading import Range
from peerd.sched.elements import PerFamily
from peerd.sched.hosts import HostShare

Auto = Literal["auto"]
Positive = Annotated[float, Range(gt=0)]
Count = Annotated[int, Range(ge=1)]


@dataclass
class Device:
    """One accelerator that can hold one tasklet."""

    id: str
    """Unique device id (a peer id, or ``peer/cuda:0`` for multi-GPU peers)."""
    region: str = ""
    """Region label; must name a row of ``regions.names`` when region matrices are given."""
    tflops: Annotated[float, Range(ge=0)] = 0.0
    """Measured dense throughput in TFLOPS; 0 = unknown (the ``dtfm`` objective ignores compute)."""
    memory_gb: Annotated[float, Range(ge=0)] = 0.0
    """Accelerator memory in GB (1e9 bytes); 0 = unknown."""
    access_mbps: Annotated[float | None, Range(gt=0)] = None
    """Optional access-link cap: region-level bandwidth to/from this device never exceeds it."""
    memory_bandwidth_gb_s: Annotated[float | None, Range(gt=0)] = None
    """Accelerator memory bandwidth in GB/s (1e9 bytes/s); None = unknown. The RL scheduler needs it
    (decoding is memory-bound); the ``peerd`` objective prices ``model.layer_work``'s traffic with it."""
    launch_us: Annotated[float | None, Range(gt=0)] = None
    """Microseconds one dispatched device op costs beyond its arithmetic (framework and launch
    overhead, measured on a small model); None = not modelled. The RL scheduler adds it per op
    counted in the workload's ``launches``, the ``peerd`` objective per op of ``model.layer_work``
    (what dominates models too small to fill the device)."""
    element_ns: PerFamily | None = None
    """Nanoseconds per unit of the ops that cost more than their launch and traffic
    (``peerd.sched.elements``); None = not modelled. The RL scheduler adds them per unit counted in
    the workload's ``launches``, the ``peerd`` objective per unit of ``model.layer_work``."""
    host: HostShare | None = None
    """The machine a CPU device computes on and its cores (``peerd.sched.hosts``); None = its own. An
    rl job's consensus scoring (``peerd.jobs.scoring_rl``) slows the devices of one machine that
    compute at once with more threads than it has cores; ``peerd plan`` refuses it."""
    message_us: Annotated[float | None, Range(gt=0)] = None
    """Microseconds of its machine's CPU per message the device's daemon sends or receives (its
    framing and its p2pd's share; measured on a loopback pair, ``peerd.pipeline.messaging``); None =
    not modelled. With ``wire_byte_ns``, the ``peerd`` objective counts a layout's messages on the
    cores of ``host`` (so both need it): a machine cannot run its daemons' compute and messaging in
    less than their CPU time over its cores."""
    wire_byte_ns: Annotated[float | None, Range(gt=0)] = None
    """Nanoseconds of its machine's CPU per payload byte the device sends or receives; None = not
    modelled (see ``message_us``)."""
    idle_cores: Annotated[float | None, Range(gt=0)] = None
    """Cores of ``host`` the device's daemon keeps busy while it works for no job (its DHT's upkeep,
    heartbeats; measured live); None = none. The ``peerd`` objective leaves them out of the
    cores the machine has for the layout's work."""
    codec_us: Annotated[float | None, Range(gt=0)] = None
    """Microseconds of its machine's CPU per call of a compressing boundary codec (an encode or a
    decode: its Python and dispatch, whatever the size; measured, ``peerd.pipeline.messaging``);
    None = not modelled. With ``codec_value_ns``, the ``peerd`` objective counts a layout's codec
    calls on the cores of ``host``."""
    codec_value_ns: Annotated[float | None, Range(gt=0)] = None
    """Nanoseconds of its machine's CPU per value a compressing codec call encodes or decodes."""

    def problems(self) -> list[ConfigError]:
        out = [] if self.id else [ConfigError("id", "must be a non-empty string")]
        for key in ("message_us", "wire_byte_ns", "idle_cores", "codec_us", "codec_value_ns"):
            if getattr(self, key) is not None and self.host is None:
                out.append(ConfigError(key, "is priced on a machine's cores: it needs host"))
        return out


@dataclass
class Regions:
    """Region-level link matrices (row = sender region, column = receiver region)."""

    names: list[str]
    delay_ms: Annotated[list[list[float | None]], Range(ge=0)]
    """One-way delay in milliseconds; ``null`` marks an unmeasured pair."""
    bandwidth_mbps: Annotated[list[list[float | None]], Range(gt=0)]
    """Bandwidth in megabits per second (1e6 bit/s); ``null`` marks an unmeasured pair."""

    def problems(self) -> list[ConfigError]:
        dups = sorted({n for n in self.names if self.names.count(n) > 1})
        out = [ConfigError("names", f"duplicate region name {d!r}") for d in dups]
        r = len(self.names)
        for key in ("delay_ms", "bandwidth_mbps"):
            rows = getattr(self, key)
            if len(rows) != r:
                out.append(ConfigError(key, f"must have {r} rows (one per region name), got {len(rows)}"))
            out += [
                ConfigError(f"{key}[{i}]", f"must have {r} columns, got {len(row)}")
                for i, row in enumerate(rows)
                if len(row) != r
            ]
        return out


@dataclass
class Link:
    """A measured device-to-device link (directional unless ``symmetric``)."""

    src: str
    dst: str
    delay_ms: Annotated[float | None, Range(ge=0)] = None
    """One-way delay in ms; omitted = fall back to the region matrix."""
    bandwidth_mbps: Annotated[float | None, Range(gt=0)] = None
    """Bandwidth in Mbit/s; omitted = fall back to the region matrix."""
    symmetric: bool = False
    """Also use these values for dst -> src."""

    def problems(self) -> list[ConfigError]:
        out = []
        if self.delay_ms is None and self.bandwidth_mbps is None:
            out.append(ConfigError("delay_ms", "a link needs delay_ms, bandwidth_mbps or both"))
        if self.src == self.dst:
            out.append(ConfigError("dst", f"a link must join two different devices, got {self.src!r} twice"))
        return out


@dataclass(frozen=True)
class LayerWork:
    """What one micro-batch's forward and backward through a layer costs beside its FLOPs, and what
    its optimizer step costs, counted on the runtime's code (``peerd.pipeline.launches``); the
    ``peerd`` objective prices it at each device's measured ``launch_us``, ``memory_bandwidth_gb_s``
    and ``element_ns``."""

    ops: Annotated[float, Range(ge=0)] = 0.0
    """Dispatched device ops."""
    traffic_bytes: Annotated[float, Range(ge=0)] = 0.0
    """Bytes those ops read and write beyond the layer's weights (activations, gradients)."""
    elements: PerFamily = field(default_factory=PerFamily)
    """Units of the ops that cost more than their launch and traffic (``peerd.sched.elements``)."""
    update_ops: Annotated[float, Range(ge=0)] = 0.0
    """Ops of one optimizer step over the layer's parameters (with the rollback copy of its state
    that a job's tasklets keep), once per iteration."""
    update_traffic_bytes: Annotated[float, Range(ge=0)] = 0.0
    """Bytes that step reads and writes (weights, gradients, optimizer state, their copies)."""


@dataclass(frozen=True)
class AveragingWork:
    """One member's arithmetic in one all-reduce of a stage's gradients (flatten, encode, decode,
    reduce, unflatten), counted on the runtime's code (``peerd.averaging.work``); the ``peerd``
    objective prices it at the stage's slowest member's measured seconds per op and memory
    bandwidth. In a group of D: ``ops + ops_per_partner (D - 1)`` ops and, per gradient value,
    ``bytes_per_value + bytes_per_value_partners (D - 1) / D`` bytes read and written."""

    ops: Annotated[float, Range(ge=0)] = 0.0
    ops_per_partner: Annotated[float, Range(ge=0)] = 0.0
    bytes_per_value: Annotated[float, Range(ge=0)] = 0.0
    bytes_per_value_partners: Annotated[float, Range(ge=0)] = 0.0

    def at(self, members: int) -> tuple[float, float]:
        """(ops, bytes per value) of one member of a group of ``members``; nothing alone."""
        if members < 2:
            return 0.0, 0.0
        return (
            self.ops + self.ops_per_partner * (members - 1),
            self.bytes_per_value + self.bytes_per_value_partners * (members - 1) / members,
        )


@dataclass
class ModelShape:
    """The model being trained, as far as the scheduler needs it."""

    layers: Count
    """Number of transformer blocks (the unit a stage holds)."""
    hidden: Count
    """Hidden size (activations crossing a stage boundary are seq x hidden per sequence)."""
    seq: Count
    """Sequence length in tokens."""
    params: Annotated[float | None, Range(gt=0)] = None
    """Total parameters; each layer gets params / layers. Default 12 * hidden^2 per layer."""
    layer_params: Annotated[list[float] | None, Range(gt=0)] = None
    """Parameters of each layer (overrides ``params``)."""
    layer_work: list[LayerWork] | None = None
    """Per layer, one micro-batch's (``training.micro_batch`` sequences) ops, traffic and element
    units beside its FLOPs; None = compute priced by FLOPs alone (``peerd`` objective only)."""
    name: str = ""

    def problems(self) -> list[ConfigError]:
        out = []
        for name in ("layer_params", "layer_work"):
            given = getattr(self, name)
            if given is not None and len(given) != self.layers:
                out.append(ConfigError(name, f"must list {self.layers} layers, got {len(given)}"))
        return out

    def per_layer_params(self) -> np.ndarray:
        """Parameters of each layer, shape (layers,)."""
        if self.layer_params is not None:
            return np.asarray(self.layer_params, dtype=float)
        each = self.params / self.layers if self.params is not None else 12.0 * self.hidden**2
        return np.full(self.layers, float(each))


@dataclass
class TrainingSpec:
    """Batch, parallel shape, compression and the communication sizes the cost models use."""

    global_batch: Count
    """Sequences per optimizer step (all replicas together)."""
    micro_batch: Count = 1
    """Sequences per micro-batch inside a pipeline."""
    d_pp: Annotated[int | Auto, Range(ge=1)] = "auto"
    """Pipeline depth (stages), or ``auto``."""
    d_dp: Annotated[int | Auto, Range(ge=1)] = "auto"
    """Data-parallel width (replicas per stage), or ``auto``."""
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """Micro-batch schedule: different activation memory; 1F1B also waits a round trip every d_pp micro-batches."""
    forward_ratio: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Compressed / raw bytes of forward activations (e.g. 0.25 for 4-bit of fp16)."""
    backward_ratio: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Compressed / raw bytes of backward activation gradients."""
    gradient_ratio: Annotated[float, Range(gt=0, le=1)] = 1.0
    """Compressed / raw bytes of data-parallel gradient traffic."""
    activation_bytes: Annotated[int, Range(gt=0)] = 2
    """Bytes per activation element on the wire before compression (fp16)."""
    gradient_bytes: Annotated[int, Range(gt=0)] = 4
    """Bytes per gradient element exchanged between replicas (fp32, as DT-FM)."""
    state_bytes_per_param: Positive = 16.0
    """Device memory per parameter for weights, gradients and optimizer state (Adam, mixed precision)."""
    activation_memory_per_token_layer: Annotated[float | None, Range(gt=0)] = None
    """Bytes of stored activations per token per layer; default 34 * hidden (2 * hidden with recompute)."""
    recompute: bool = False
    """Activation recomputation: less memory, one more forward pass in the backward."""
    c_dp_bytes: Annotated[float | None, Range(gt=0)] = None
    """Explicit gradient bytes of one (even) stage; overrides the value derived from the model."""
    c_pp_bytes: Annotated[float | None, Range(gt=0)] = None
    """Explicit activation bytes one tasklet sends across a stage boundary per iteration."""
    norm_exchange: bool = False
    """The stages pass the replica's gradient norm along the pipeline after the all-reduce (gradient
    clipping): partial sums up to stage 0, the total back down. The ``peerd`` objective adds that
    trip, one small message per boundary each way."""
    averaging_work: AveragingWork | None = None
    """What averaging a stage's gradients costs each member's host beside the links (the
    ``peerd`` objective adds it to the stage's exchange); None: not priced."""


@dataclass
class Scenario:
    """Devices, links, and optionally the model and training setup to plan for."""

    devices: list[Device]
    name: str = ""
    description: str = ""
    regions: Regions | None = None
    links: list[Link] = field(default_factory=list)
    estimate_missing: bool = False
    """Fill unmeasured pairs with the best two-hop relay estimate instead of failing."""
    model: ModelShape | None = None
    training: TrainingSpec | None = None

    def problems(self) -> list[ConfigError]:
        out = [] if self.devices else [ConfigError("devices", "must list at least one device")]
        seen: set[str] = set()
        for i, dev in enumerate(self.devices):
            if dev.id in seen:
                out.append(ConfigError(f"devices[{i}].id", f"duplicate device id {dev.id!r}"))
            seen.add(dev.id)
            if self.regions is not None and dev.region not in self.regions.names:
                where = f"regions.names {self.regions.names}"
                out.append(ConfigError(f"devices[{i}].region", f"{dev.region!r} is not in {where}"))
        for i, link in enumerate(self.links):
            for end in ("src", "dst"):
                if getattr(link, end) not in seen:
                    out.append(ConfigError(f"links[{i}].{end}", f"unknown device id {getattr(link, end)!r}"))
        return out

    def __post_init__(self) -> None:
        # Programmatic construction gets the same checks as loading from a file.
        loading.check(loading.problems(self), "the scenario")
        self._index = {dev.id: i for i, dev in enumerate(self.devices)}
        self._cache: dict[str, np.ndarray] = {}

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> Scenario:
        """Build from a plain mapping (parsed YAML/JSON); ConfigError names each bad field."""
        return loading.from_mapping(cls, data)

    # --- lookups ------------------------------------------------------------------------
    @property
    def device_ids(self) -> list[str]:
        return [d.id for d in self.devices]

    def index_of(self, device_id: str) -> int:
        try:
            return self._index[device_id]
        except KeyError:
            raise ConfigError("devices", f"unknown device id {device_id!r}") from None

    def delay_s(self, src_id: str, dst_id: str) -> float:
        """One-way delay from ``src_id`` to ``dst_id`` in seconds (0 for a device to itself)."""
        return self._pair(self.delay_matrix(), src_id, dst_id, "delay")

    def bandwidth_bps(self, src_id: str, dst_id: str) -> float:
        """Bandwidth from ``src_id`` to ``dst_id`` in bits/s (inf for a device to itself)."""
        return self._pair(self.bandwidth_matrix(), src_id, dst_id, "bandwidth")

    def _pair(self, matrix: np.ndarray, src_id: str, dst_id: str, what: str) -> float:
        i, j = self.index_of(src_id), self.index_of(dst_id)
        value = float(matrix[i, j])
        if math.isnan(value):
            raise ConfigError(
                "links",
                f"no {what} for {src_id!r} -> {dst_id!r}: no device link, no region value "
                f"({self.devices[i].region!r} -> {self.devices[j].region!r}) and estimate_missing is off",
            )
        return value

    # --- matrices -----------------------------------------------------------------------
    def delay_matrix(self) -> np.ndarray:
        """One-way delays in seconds, shape (N, N) in device order; NaN = unknown, diagonal 0."""
        if "delay" not in self._cache:
            self._build_matrices()
        return self._cache["delay"]

    def bandwidth_matrix(self) -> np.ndarray:
        """Bandwidths in bits/s, shape (N, N) in device order; NaN = unknown, diagonal inf."""
        if "bandwidth" not in self._cache:
            self._build_matrices()
        return self._cache["bandwidth"]

    def missing_pairs(self) -> list[tuple[str, str]]:
        """Directional device pairs with no value (before estimation); empty when complete."""
        delay, bw = self._raw_matrices()
        bad = np.argwhere(np.isnan(delay) | np.isnan(bw))
        return [(self.devices[i].id, self.devices[j].id) for i, j in bad]

    def _raw_matrices(self) -> tuple[np.ndarray, np.ndarray]:
        if "raw_delay" in self._cache:
            return self._cache["raw_delay"], self._cache["raw_bw"]
        n = len(self.devices)
        delay = np.full((n, n), np.nan)
        bw = np.full((n, n), np.nan)
        if self.regions is not None:
            rindex = {name: k for k, name in enumerate(self.regions.names)}
            r = np.array([rindex[d.region] for d in self.devices], dtype=np.intp)
            rdelay = np.array(self.regions.delay_ms, dtype=float) / 1e3
            rbw = np.array(self.regions.bandwidth_mbps, dtype=float) * 1e6
            delay = rdelay[r[:, None], r[None, :]]
            bw = rbw[r[:, None], r[None, :]]
            access = np.array(
                [d.access_mbps * 1e6 if d.access_mbps is not None else np.inf for d in self.devices]
            )
            bw = np.minimum(bw, np.minimum(access[:, None], access[None, :]))  # NaN stays NaN
        for link in self.links:
            pairs = [(link.src, link.dst)] + ([(link.dst, link.src)] if link.symmetric else [])
            for s, d in pairs:
                i, j = self._index[s], self._index[d]
                if link.delay_ms is not None:
                    delay[i, j] = link.delay_ms / 1e3
                if link.bandwidth_mbps is not None:
                    bw[i, j] = link.bandwidth_mbps * 1e6
        np.fill_diagonal(delay, 0.0)
        np.fill_diagonal(bw, np.inf)
        self._cache["raw_delay"], self._cache["raw_bw"] = delay, bw
        return delay, bw

    def _build_matrices(self) -> None:
        delay, bw = self._raw_matrices()
        if self.estimate_missing and (np.isnan(delay).any() or np.isnan(bw).any()):
            delay, bw = _two_hop_estimate(delay, bw)
        for m in (delay, bw):
            m.setflags(write=False)
        self._cache["delay"], self._cache["bandwidth"] = delay, bw


def load_scenario(path: str | Path) -> Scenario:
    """Load a scenario from a YAML or JSON file (ConfigError names the offending field)."""
    return Scenario.from_mapping(loading.load_mapping(path))


def _two_hop_estimate(delay: np.ndarray, bw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fill NaN pairs with the best relay through one third device: delays add, bandwidth is the narrower hop.

    A relay path physically exists, so this is an achievable (pessimistic) estimate,
    not a guess; pairs with no measured two-hop path stay NaN.
    """
    delay, bw = delay.copy(), bw.copy()
    d_known = np.where(np.isnan(delay), np.inf, delay)
    b_known = np.where(np.isnan(bw), 0.0, bw)
    rows = np.argwhere(np.isnan(delay).any(axis=1) | np.isnan(bw).any(axis=1)).ravel()
    for i in rows:  # one vectorised (N, N) pass per incomplete row keeps memory at O(N^2)
        via_d = (d_known[i][:, None] + d_known).min(axis=0)  # min over relays k of d[i,k] + d[k,j]
        via_b = np.minimum(b_known[i][:, None], b_known).max(axis=0)
        miss_d = np.isnan(delay[i]) & np.isfinite(via_d)
        miss_b = np.isnan(bw[i]) & (via_b > 0)
        delay[i, miss_d] = via_d[miss_d]
        bw[i, miss_b] = via_b[miss_b]
    return delay, bw
