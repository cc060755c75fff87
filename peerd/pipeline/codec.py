"""Boundary codecs of a stage worker: activations and gradients to message payloads and back.

A job's compression settings pick, per direction, ``none`` (raw fp32 bytes, exact), ``acsgd``
(forward only: peerd.compress's AC-SGD delta codec with per-example buffers on both sides of
the boundary) or ``quant`` (stateless b-bit uniform quantization, the usual choice backward).
The codec's name travels in every message header, so a receiver configured differently
rejects the message (UNKNOWN_CODEC) instead of misreading it. Gradients exchanged among
data-parallel replicas are compressed by the averaging group (``gradient_compressor``).

Devices: encoders compute on the device of the tensor they are given (the stage's) and only
the payload bytes leave it (``peerd.compress.device.to_host``: pinned, non-blocking on CUDA);
quantized and AC-SGD decoders reconstruct onto the stage's device, and AC-SGD buffers live
there up to ``buffer_device_mb``, then in (pinned) host RAM, then in spill files, up to
``buffer_total_mb`` per side in all (a job cannot make a peer buffer more). The raw
decoder hands out a zero-copy host view of the payload: the worker moves it to its device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch

from peerd.compress.codecs import TensorCodec, make_codec
from peerd.compress.delta import DeltaConfig, DeltaDecoder, DeltaEncoder
from peerd.compress.device import to_host
from peerd.compress.quant import QuantConfig
from peerd.errors import ConfigError, ErrorCode, ProtocolError
from peerd.pipeline.frames import TensorMessage, raw_payload, raw_tensor

Payload = bytes | bytearray | memoryview


@dataclass(frozen=True)
class CompressionConfig:
    """What crosses stage boundaries and replica groups, and how compressed."""

    forward: Literal["none", "acsgd", "quant"] = "none"
    """Activations: raw fp32, AC-SGD deltas, or direct quantization."""
    forward_bits: int = 4
    """Code width of forward deltas / values (2, 3, 4 or 8)."""
    backward: Literal["none", "quant"] = "none"
    """Activation gradients: raw fp32 or quantized."""
    backward_bits: int = 8
    """Code width of backward values."""
    gradients: Literal["none", "quant"] = "none"
    """Data-parallel gradient averaging: lossless fp32, or quantized with error feedback."""
    gradient_bits: int = 8
    """Code width of averaged gradients."""
    warmup_visits: int = 1
    """AC-SGD: visits of an example sent through the stateless seed codec before deltas start."""
    seed_codec: str = "fp32"
    """AC-SGD: stateless codec of first (warm-up) visits (fp32, fp16, bf16, q8, ...)."""
    stochastic_rounding: bool = False
    """Unbiased randomized rounding in the quantizers (what the convergence proof assumes)."""
    buffer_device_mb: float = 1024.0
    """AC-SGD buffers kept in GPU/MPS memory per boundary side (device stages only); beyond it
    they go to host RAM (page-locked on CUDA)."""
    buffer_ram_mb: float = 1024.0
    """AC-SGD buffers kept in host RAM per boundary side; beyond it they spill to memory-mapped files."""
    buffer_total_mb: float = 8192.0
    """AC-SGD buffers per boundary side in all (device, RAM and spill files): what one job can make
    a peer hold, whatever its spec's data and batch sizes; beyond it new examples travel
    unbuffered (seed codec). Both sides of a boundary must use the same value."""

    def validate(self) -> None:
        for name in ("forward_bits", "backward_bits", "gradient_bits"):
            if getattr(self, name) not in (2, 3, 4, 8):
                raise ConfigError(name, f"must be one of 2, 3, 4, 8, got {getattr(self, name)}")
        if self.warmup_visits < 1:
            raise ConfigError("warmup_visits", f"must be >= 1, got {self.warmup_visits}")
        for name in ("buffer_device_mb", "buffer_ram_mb", "buffer_total_mb"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")

    def quant(self, bits: int) -> QuantConfig:
        return QuantConfig(bits=bits, rounding="stochastic" if self.stochastic_rounding else "nearest")

    @property
    def forward_name(self) -> str:
        """The codec name activation messages carry."""
        return {"none": "none", "acsgd": f"acsgd-q{self.forward_bits}", "quant": f"q{self.forward_bits}"}[
            self.forward
        ]

    @property
    def backward_name(self) -> str:
        return "none" if self.backward == "none" else f"q{self.backward_bits}"

    @property
    def gradient_compressor(self) -> str | None:
        """What the averaging group is given (None: lossless)."""
        return None if self.gradients == "none" else f"q{self.gradient_bits}"


class Encoder(Protocol):
    name: str

    def encode(self, ids: tuple[int, ...], x: torch.Tensor) -> Payload: ...


class Decoder(Protocol):
    name: str
    inline: bool  # cheap enough to run on the event loop (a thread hop costs more under GIL contention)

    def decode(self, msg: TensorMessage, payload: bytearray) -> torch.Tensor: ...


class RawEncoder:
    """Codec ``none``: the tensor's own bytes."""

    name = "none"

    def encode(self, ids: tuple[int, ...], x: torch.Tensor) -> Payload:
        return raw_payload(to_host(x.detach().contiguous()))


class RawDecoder:
    name = "none"
    inline = True  # a zero-copy view plus one finiteness pass

    def decode(self, msg: TensorMessage, payload: bytearray) -> torch.Tensor:
        t = raw_tensor(msg, payload)
        # numpy, not torch: this runs on the event loop, and torch's intra-op thread pool stalls
        # for tens of ms when the cores are busy (measured: 0.08 ms vs 1-30 ms for 4 MiB)
        if not bool(np.isfinite(t.numpy()).all()):
            raise ProtocolError("raw tensor holds NaN or Inf", code=ErrorCode.NON_FINITE)
        return t


class QuantEncoder:
    """Stateless uniform quantization (peerd.compress frame format)."""

    def __init__(self, name: str, quant: QuantConfig) -> None:
        self.name = name
        self.codec: TensorCodec = make_codec("uniform", quant)

    def encode(self, ids: tuple[int, ...], x: torch.Tensor) -> Payload:
        data, _ = self.codec.encode(x.detach())
        return data


class QuantDecoder:
    inline = False

    def __init__(self, name: str, quant: QuantConfig, device: torch.device | None = None) -> None:
        self.name = name
        self.codec: TensorCodec = make_codec("uniform", quant)
        self.device = device or torch.device("cpu")

    def decode(self, msg: TensorMessage, payload: bytearray) -> torch.Tensor:
        return self.codec.decode(payload, device=self.device)


class DeltaBoundaryEncoder:
    """AC-SGD sender side of one boundary (its buffers mirror the receiver's)."""

    stateful = True  # per-example buffers: saved with the stage checkpoint

    def __init__(self, name: str, cfg: DeltaConfig) -> None:
        self.name = name
        self.codec = DeltaEncoder(cfg)

    def encode(self, ids: tuple[int, ...], x: torch.Tensor) -> Payload:
        return self.codec.encode(x.detach(), ids)

    def buffers(self) -> dict[str, Any]:
        return dataclasses.asdict(self.codec.stats())


class DeltaBoundaryDecoder:
    """AC-SGD receiver side: the stage runs on the reconstruction m(id)."""

    inline = False
    stateful = True  # decodes must not run ahead of the stage's checkpoint (see streams.Inbox.hold)

    def __init__(self, name: str, cfg: DeltaConfig, device: torch.device | None = None) -> None:
        self.name = name
        self.codec = DeltaDecoder(cfg, device=device or torch.device("cpu"))

    def decode(self, msg: TensorMessage, payload: bytearray) -> torch.Tensor:
        acts, ids = self.codec.decode(payload)
        if tuple(ids) != msg.ids:
            raise ProtocolError(
                "codec packet ids differ from the message's ids", code=ErrorCode.UNKNOWN_EXAMPLE
            )
        return acts

    def buffers(self) -> dict[str, Any]:
        return dataclasses.asdict(self.codec.stats())


@dataclass
class BoundaryCodecs:
    """The codecs one stage worker uses: encoders for what it sends, decoders for what it receives."""

    send_act: Encoder | None = None  # to the next stage
    recv_act: Decoder | None = None  # from the previous stage
    send_grad: Encoder | None = None  # to the previous stage
    recv_grad: Decoder | None = None  # from the next stage

    def buffers(self) -> dict[str, Any]:
        """Sizes of AC-SGD buffers (checkpoint metadata, reports)."""
        out = {}
        for name in ("send_act", "recv_act"):
            side = getattr(self, name)
            if side is not None and hasattr(side, "buffers"):
                out[name] = side.buffers()
        return out

    def state_dict(self) -> dict[str, Any]:
        """AC-SGD buffers of both boundary sides this stage holds (empty without AC-SGD)."""
        return {name: side.codec.state_dict() for name, side in self._stateful()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sides saved in ``state``; a side it lacks starts with empty buffers."""
        for name, side in self._stateful():
            if name in state:
                side.codec.load_state_dict(state[name])
            else:
                side.codec.invalidate()

    def _stateful(self) -> list[tuple[str, Any]]:
        return [
            (name, side)
            for name, side in (("send_act", self.send_act), ("recv_act", self.recv_act))
            if getattr(side, "stateful", False)
        ]

    def close(self) -> None:
        """Release AC-SGD buffers (spill files)."""
        for side in (self.send_act, self.recv_act):
            codec = getattr(side, "codec", None)
            if codec is not None and hasattr(codec, "close"):
                codec.close()


def _delta_config(cfg: CompressionConfig, device: torch.device) -> DeltaConfig:
    d = DeltaConfig(
        quant=cfg.quant(cfg.forward_bits), seed_codec=cfg.seed_codec, warmup_visits=cfg.warmup_visits
    )
    d.buffers.device = str(device)
    d.buffers.device_budget_mb = cfg.buffer_device_mb
    d.buffers.ram_budget_mb = cfg.buffer_ram_mb
    d.buffers.total_budget_mb = cfg.buffer_total_mb
    d.validate()
    return d


def _side(cfg: CompressionConfig, direction: str, sending: bool, device: torch.device) -> Any:
    """The encoder (``sending``) or decoder of one direction (``forward`` / ``backward``)."""
    kind = getattr(cfg, direction)
    name = cfg.forward_name if direction == "forward" else cfg.backward_name
    if kind == "acsgd":
        if sending:
            return DeltaBoundaryEncoder(name, _delta_config(cfg, device))
        return DeltaBoundaryDecoder(name, _delta_config(cfg, device), device)
    if kind == "quant":
        bits = cfg.forward_bits if direction == "forward" else cfg.backward_bits
        if sending:
            return QuantEncoder(name, cfg.quant(bits))
        return QuantDecoder(name, cfg.quant(bits), device)
    return RawEncoder() if sending else RawDecoder()


def build_codecs(
    cfg: CompressionConfig, *, first: bool, last: bool, device: torch.device | str = "cpu"
) -> BoundaryCodecs:
    """Codecs of a stage on ``device``: the first stage receives no activations, the last sends none."""
    cfg.validate()
    dev = torch.device(device)
    out = BoundaryCodecs()
    if not last:
        out.send_act, out.recv_grad = _side(cfg, "forward", True, dev), _side(cfg, "backward", False, dev)
    if not first:
        out.recv_act, out.send_grad = _side(cfg, "forward", False, dev), _side(cfg, "backward", True, dev)
    return out
