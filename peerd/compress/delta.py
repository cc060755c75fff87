"""The AC-SGD activation-delta codec for one stage boundary: sender (encoder) and receiver (decoder).

Per example id ``e`` both sides keep a buffer ``m(e)``. A first visit (or one of the first
``warmup_visits``) goes through a stateless seed codec and both sides set ``m(e)`` to what the
receiver decodes; later visits send ``Q(a - m)`` and both sides do ``m += D(Q(a - m))`` with
the same exact arithmetic (quant.py), so the two stores stay bit-identical and ``a - m`` after
a visit is exactly that visit's quantization error. The receiver's stage runs on ``m(e)``.

Both sides validate and compute everything before touching their stores, so a rejected
micro-batch (NaN input, malformed packet) leaves both stores as they were. Either side's
``state_dict`` (buffers + the codec settings they were built with) loads into either side: the
two are mirror images, so a checkpoint of one end can also seed its replacement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from peerd.compress import wire
from peerd.compress.buffers import BufferConfig, BufferStats, BufferStore
from peerd.compress.codecs import (
    UniformCodec,
    codec_names,
    decode_frame,
    frame_levels,
    frame_quant_config,
    make_codec,
)
from peerd.compress.quant import QuantConfig, Quantized, Workspace, dequantize_into
from peerd.errors import CodecError, ConfigError, ErrorCode
from peerd.log import get_logger

log = get_logger(__name__)


@dataclass
class DeltaConfig:
    """Forward-activation compression at one boundary (AC-SGD)."""

    quant: QuantConfig = field(default_factory=lambda: QuantConfig(bits=4))
    """How deltas are quantized."""
    seed_codec: str = "bf16"
    """Stateless codec (registry name) for first visits, warm-up visits and unbuffered examples."""
    warmup_visits: int = 1
    """Visits of each example sent through the seed codec before deltas start (>= 1)."""
    buffers: BufferConfig = field(default_factory=BufferConfig)

    def validate(self) -> None:
        self.quant.validate()
        self.buffers.validate()
        if self.warmup_visits < 1:
            raise ConfigError("warmup_visits", "must be >= 1 (the first visit always seeds the buffer)")
        if self.seed_codec not in codec_names():
            raise ConfigError(
                "seed_codec", f"unknown codec {self.seed_codec!r} (known: {', '.join(codec_names())})"
            )


def _check_ids(acts: torch.Tensor, ids: Sequence[int]) -> tuple[int, ...]:
    ids = tuple(int(i) for i in ids)
    if acts.dim() < 1 or acts.shape[0] != len(ids):
        raise CodecError(
            f"{len(ids)} ids for activations of shape {tuple(acts.shape)}", code=ErrorCode.SHAPE_MISMATCH
        )
    if len(set(ids)) != len(ids) or any(not 0 <= i < 2**64 for i in ids):
        raise CodecError("example ids must be distinct integers in [0, 2**64)", code=ErrorCode.MALFORMED)
    return ids


def _check_groups(store: BufferStore, quant: QuantConfig) -> None:
    if quant.layout == "group" and store.example_numel % quant.group_size:
        raise CodecError(
            f"group size {quant.group_size} does not divide the example size {store.example_numel}",
            code=ErrorCode.SHAPE_MISMATCH,
        )


def _same_device(views: list[torch.Tensor], device: torch.device) -> bool:
    return all(v.device == device for v in views)


def _stacked(views: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(n, *S) float32 copy of ``views`` on ``device``: one stack instead of n conversions.

    Rows may sit in different tiers of the store (device memory, pinned RAM, spill files):
    then each row is copied to ``device`` first.
    """
    first = views[0].device
    if _same_device(views, first):
        return torch.stack(views).to(device=device, dtype=torch.float32)
    # host-to-device copies may run asynchronously (stream order); device-to-host ones may not
    asynchronous = device.type != "cpu"
    return torch.stack([v.to(device=device, dtype=torch.float32, non_blocking=asynchronous) for v in views])


def _write(views: list[torch.Tensor], rows: torch.Tensor) -> None:
    """views[i] <- rows[i], rounding to the storage dtype (the same rounding on both sides)."""
    if _same_device(views, rows.device):
        torch._foreach_copy_(views, list(rows.unbind(0)))  # one dispatch for all rows
    else:  # rows of other tiers: a blocking copy each (the store must hold them when this returns)
        for v, row in zip(views, rows.unbind(0), strict=True):
            v.copy_(row)


def _update_rows(
    store: BufferStore,
    ids: Sequence[int],
    k: torch.Tensor,
    scales: torch.Tensor,
    quant: QuantConfig,
    work: Workspace,
    out: torch.Tensor | None = None,
) -> None:
    """m(id) += k_row * s for all rows at once (identical arithmetic on both sides); new m copied into ``out``.

    Element-wise, the same as row by row: channel scales are shared by every row, and groups
    never straddle examples (``_check_groups``), so one batched dequantize is exact.
    """
    per = store.example_numel
    n = per * len(ids)
    # Levels as float32 once: a mixed int8 x float addcmul_ would cast per call into a fresh temporary.
    kf = work.get("levels_f32", n, torch.float32, k.device)
    kf.copy_(k[:n])
    views = [store.get(ex) for ex in ids]
    cur = _stacked(views, k.device)  # (n, *S) float32
    dequantize_into(cur, kf, scales, quant, add=1.0)
    _write(views, cur)
    if out is not None:
        # what the store now holds (its dtype's rounding of cur), as float32
        out.copy_(cur if views[0].dtype == torch.float32 else _stacked(views, out.device))


class _BoundarySide:
    """What both ends of a boundary have: the settings, the buffer store, invalidation and checkpoints."""

    def __init__(self, cfg: DeltaConfig | None) -> None:
        self.cfg = cfg or DeltaConfig()
        self.cfg.validate()
        self.store = BufferStore(self.cfg.buffers)

    def invalidate(self, ids: list[int] | None = None) -> None:
        """The other side lost its buffers (new neighbour, restart): start over with first visits."""
        self.store.invalidate(ids)

    def stats(self) -> BufferStats:
        return self.store.stats()

    def state_dict(self) -> dict[str, Any]:
        """Buffers and visit counts (stored precision) plus the settings they were built with."""
        return {"codec": dataclasses.asdict(self.cfg), "buffers": self.store.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` of this side, or of the other side of the same boundary."""
        if not isinstance(state, dict) or "buffers" not in state:
            raise CodecError("not an AC-SGD codec state", code=ErrorCode.MALFORMED)
        saved = state.get("codec") or {}
        mine = dataclasses.asdict(self.cfg)
        # Buffers are reconstructions both sides agree on, whatever quantizer made them, so other
        # delta settings are allowed (e.g. resuming at fewer bits); say so, it changes the curve.
        changed = sorted(k for k in mine if k != "buffers" and saved.get(k) != mine[k])
        if changed:
            log.warning("AC-SGD buffers were saved with other settings (%s): loading them anyway", changed)
        self.store.load_state_dict(state["buffers"])

    def close(self) -> None:
        self.store.close()


class DeltaEncoder(_BoundarySide):
    """Sender side of one boundary: activations + example ids -> packet bytes."""

    def __init__(self, cfg: DeltaConfig | None = None, generator: torch.Generator | None = None) -> None:
        super().__init__(cfg)
        self.delta_codec = UniformCodec(self.cfg.quant, generator=generator)
        self.seed_codec = make_codec(self.cfg.seed_codec)

    def encode(self, acts: torch.Tensor, ids: Sequence[int]) -> bytes:
        """Compress one micro-batch ``acts`` (B, *S), row ``i`` belonging to example ``ids[i]``."""
        ids = _check_ids(acts, ids)
        acts = acts.detach()
        store = self.store
        store.check_shape(tuple(acts.shape[1:]))
        _check_groups(store, self.cfg.quant)
        delta_rows, seed_rows, plain_rows = [], [], []
        for r, ex in enumerate(ids):
            if ex in store and store.visits(ex) >= self.cfg.warmup_visits:
                delta_rows.append(r)
            else:
                seed_rows.append(r)
        new = [r for r in seed_rows if ids[r] not in store]
        room = store.room()
        if room is not None and len(new) > room:  # budgets full: the rest travel unbuffered
            plain_rows = new[room:]
            seed_rows = [r for r in seed_rows if r not in set(plain_rows)]
        frames: list[bytes] = []
        # 1. everything that can fail, before any state changes
        seed = None
        if seed_rows:
            x = acts[seed_rows] if len(seed_rows) < len(ids) else acts
            data, recon = self.seed_codec.encode(
                x, ids=[ids[r] for r in seed_rows], seed=True, reconstruct=True
            )
            frames.append(data)
            seed = recon
        if plain_rows:
            data, _ = self.seed_codec.encode(acts[plain_rows], ids=[ids[r] for r in plain_rows])
            frames.append(data)
        pending = None
        if delta_rows:
            data, pending = self._delta_frame(acts, ids, delta_rows)
            frames.append(data)
        # 2. commit: both sides apply exactly these updates
        if seed is not None:
            _write([store.slot(ids[r]) for r in seed_rows], seed)
        if pending is not None:
            k = self.delta_codec.levels(pending)
            rows = [ids[r] for r in delta_rows]
            _update_rows(store, rows, k, pending.scales, self.cfg.quant, self.delta_codec.work)
        for ex in ids:
            store.count_visit(ex)
        return wire.build_packet(wire.Packet(ids=ids, frames=frames))

    def _delta_frame(
        self, acts: torch.Tensor, ids: tuple[int, ...], rows: list[int]
    ) -> tuple[bytes, Quantized]:
        """Frame for a - m of ``rows`` (one subtraction per example into scratch), and its codes."""
        shape = (len(rows), *acts.shape[1:])
        n = 1
        for d in shape:
            n *= d
        delta = self.delta_codec.work.get("mat", n, torch.float32, acts.device).view(shape)
        m = _stacked([self.store.get(ids[r]) for r in rows], acts.device)  # (n, *S)
        torch.sub(acts[rows] if len(rows) < len(ids) else acts, m, out=delta)
        q = self.delta_codec.quantize(delta, inplace=True)
        return self.delta_codec.frame(q, acts.dtype, codec=wire.CODEC_DELTA, ids=[ids[r] for r in rows]), q


class DeltaDecoder(_BoundarySide):
    """Receiver side of one boundary: packet bytes -> reconstructed activations (B, *S)."""

    def __init__(self, cfg: DeltaConfig | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__(cfg)
        self.device = torch.device(device)
        self.work = Workspace()

    def decode(self, data: bytes | bytearray | memoryview) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The micro-batch the sender encoded, as reconstructed on this side, and its example ids."""
        ids, frames = wire.parse_packet(data)
        store = self.store
        dtypes = {f.header.dtype for f in frames}
        if len(dtypes) != 1:
            raise CodecError("frames of one packet disagree on the dtype", code=ErrorCode.DTYPE_MISMATCH)
        example_shapes = {f.header.shape[1:] for f in frames}
        if len(example_shapes) != 1:
            raise CodecError(
                "frames of one packet disagree on the example shape", code=ErrorCode.SHAPE_MISMATCH
            )
        example_shape = example_shapes.pop()
        if store.example_shape is not None and example_shape != store.example_shape:
            raise CodecError(
                f"example shape {example_shape} differs from the buffered {store.example_shape}",
                code=ErrorCode.SHAPE_MISMATCH,
            )
        # 1. decode and check everything before any state changes
        plain: list[tuple[wire.Frame, torch.Tensor]] = []
        deltas: list[tuple[wire.Frame, torch.Tensor]] = []
        new_ids = 0
        for f in frames:
            h = f.header
            if h.codec == wire.CODEC_DELTA:
                missing = [i for i in h.ids if i not in store]
                if missing:
                    raise CodecError(
                        f"delta for examples without a buffer: {missing[:5]}", code=ErrorCode.UNKNOWN_EXAMPLE
                    )
                if h.layout == "group" and _numel(example_shape) % h.group_size:
                    raise CodecError("delta groups straddle examples", code=ErrorCode.SHAPE_MISMATCH)
                deltas.append((f, frame_levels(f, self.device)))
            else:
                plain.append((f, decode_frame(f, device=self.device, float32=True)))
                new_ids += sum(1 for i in h.ids if i not in store) if h.seed else 0
        room = store.room()
        if room is not None and new_ids > room:
            raise CodecError("seed for more examples than the buffer budgets hold", code=ErrorCode.OVERSIZED)
        # 2. commit
        store.check_shape(example_shape)
        out = torch.empty((len(ids), *example_shape), dtype=torch.float32, device=self.device)
        pos = {ex: r for r, ex in enumerate(ids)}
        for f, values in plain:
            rows = [pos[i] for i in f.header.ids]
            if f.header.seed:
                views = [store.slot(ex) for ex in f.header.ids]
                _write(views, values)
                # the stage runs on what the store holds (the storage dtype's rounding of the seed)
                same = views[0].dtype == torch.float32 and views[0].device == values.device
                out[rows] = values if same else _stacked(views, out.device)
            else:
                out[rows] = values
        for f, k in deltas:
            scales = f.scales.to(self.device)  # type: ignore[union-attr]
            rows = [pos[i] for i in f.header.ids]
            contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
            target = out[rows[0] : rows[0] + len(rows)] if contiguous else torch.empty_like(out[: len(rows)])
            _update_rows(store, f.header.ids, k, scales, frame_quant_config(f.header), self.work, out=target)
            if not contiguous:
                out[rows] = target
        dtype = dtypes.pop()
        return (out if dtype == torch.float32 else out.to(dtype)), ids


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
