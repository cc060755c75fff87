"""``peerd bench compress``: AC-SGD delta and direct quantization throughput/error vs a multi-pass torch baseline.

Both run side by side in one process on the same data (interleaved call by call, so machine
load hits both alike); the JSON reports GB/s of float32 input from the median call and from
the fastest call (``_best``: least disturbed by other processes), the ratio to the baseline
and to the reference implementation's published 0.047 GB/s, relative L2 errors (direct,
and delta after each epoch of a 10 % per-epoch change) and bits per element on the wire.

The baseline is the straightforward way to write the reference's quantizer in torch:
per-channel absmax fp16 scales with an absolute epsilon, ``round(x / s * 2**(b-1))``
clipped to the asymmetric grid, and bit packing through an 8x-expanded bit array.

``--device cuda`` runs both on the GPU (tensors, codec scratch and AC-SGD buffers there; the
clock synchronizes the device around every timed call, and the wire bytes are copied to the
host as in training). Every run also reports the codec against the memory-bandwidth roofline
of the device it ran on, measured in the same run (a large device-to-device copy: read + write
bytes per second): ``touched_gbps`` counts the bytes a call must move at least (its inputs,
outputs and the buffers it reads and writes, listed in ``roofline.bytes_per_element``) per
second, and ``roofline_fraction`` divides that by the measured bandwidth.
"""

from __future__ import annotations

import os
import statistics
import time

import click
import torch

from peerd.bench import emit_json
from peerd.compress import DeltaConfig, DeltaDecoder, DeltaEncoder, QuantConfig, make_codec
from peerd.errors import ConfigError

# The reference implementation on this kind of machine (issue 4 / compression.md).
REFERENCE_DELTA_GBPS, REFERENCE_QUANTIZE_PACK_GBPS = 0.047, 0.10
REFERENCE = {
    "delta_gbps": REFERENCE_DELTA_GBPS,
    "quantize_pack_gbps": REFERENCE_QUANTIZE_PACK_GBPS,
    "direct_rel_error": {"2": 0.50, "3": 0.25, "4": 0.125},
    "delta_rel_error": {"2": 0.05, "3": 0.025, "4": 0.0125},
}


class NaiveQuantizer:
    """The multi-pass baseline: fp16 absmax scales + 1e-6, asymmetric grid, 8x bit-array packing."""

    def __init__(self, bits: int, device: torch.device | str = "cpu") -> None:
        self.bits = bits
        self.half = 2 ** (bits - 1)
        self.shift_b = torch.arange(bits, dtype=torch.uint8, device=device)
        self.shift_8 = torch.arange(8, dtype=torch.uint8, device=device)

    def encode(self, x_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale_C = x_RC.abs().amax(dim=0).half()
        s_C = scale_C.float() + 1e-6
        q_RC = torch.clamp(torch.round(x_RC / s_C * self.half), -self.half, self.half - 1)
        codes_N = (q_RC + self.half).to(torch.uint8).reshape(-1)
        bits_NB = (codes_N.unsqueeze(1) >> self.shift_b) & 1
        packed = (bits_NB.reshape(-1, 8) << self.shift_8).sum(dim=1, dtype=torch.uint8)
        return packed, scale_C

    def decode(self, packed: torch.Tensor, scale_C: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        bits_N8 = (packed.unsqueeze(1) >> self.shift_8) & 1
        codes_N = (bits_N8.reshape(-1, self.bits) << self.shift_b).sum(dim=1, dtype=torch.uint8)
        q_RC = codes_N.reshape(shape).float() - self.half
        return q_RC / self.half * (scale_C.float() + 1e-6)


class NaiveDelta:
    """Baseline AC-SGD round trip for one micro-batch tensor: sender and receiver buffers, same math."""

    def __init__(self, bits: int, device: torch.device | str = "cpu") -> None:
        self.q = NaiveQuantizer(bits, device)
        self.sender: dict[int, torch.Tensor] = {}
        self.receiver: dict[int, torch.Tensor] = {}

    def encode(self, key: int, a_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if key not in self.sender:
            self.sender[key] = a_RC.clone()
            return None
        packed, scale = self.q.encode(a_RC - self.sender[key])
        self.sender[key] += self.q.decode(packed, scale, tuple(a_RC.shape))
        return packed, scale

    def decode(
        self, key: int, msg: tuple[torch.Tensor, torch.Tensor] | None, a_RC: torch.Tensor
    ) -> torch.Tensor:
        if msg is None:
            self.receiver[key] = a_RC.clone()
        else:
            self.receiver[key] += self.q.decode(*msg, tuple(a_RC.shape))
        return self.receiver[key].clone()


class _Clock:
    """Accumulates wall times of the blocks it wraps: ``with clock: ...`` appends one sample.

    On a GPU it synchronizes before and after, so a sample is the block's device time too.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.samples: list[float] = []
        self.device = device or torch.device("cpu")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()

    def __enter__(self) -> _Clock:
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sync()
        self.samples.append(time.perf_counter() - self._t0)


def resolve_bench_device(device: str) -> torch.device:
    """The torch device for ``--device`` (``cpu``, ``cuda``, ``cuda:N``, ``mps``); ConfigError if it is not here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError("device", f"{device!r} is not a torch device: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", f"{device!r} requested but CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError("device", f"{device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device", f"{device!r} requested but MPS is not available on this machine")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ConfigError("device", f"{device!r}: expected cpu, cuda, cuda:N or mps")
    return (
        torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        if (dev.type == "cuda")
        else dev
    )


def memory_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30, repeat: int = 10) -> float:
    """Median read + write GB/s of a ``nbytes`` device-to-device copy (the roofline a streaming codec hits)."""
    numel = nbytes // 4
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    clock = _Clock(device)
    for _ in range(repeat + 1):
        with clock:
            dst.copy_(src)
    clock.samples.pop(0)  # first touch: page faults / lazy allocation
    return 2 * numel * 4 / statistics.median(clock.samples) / 1e9


# Bytes a call must move at least, per float32 element of its input (b: code width).
def delta_bytes_per_element(bits: int) -> float:
    """AC-SGD round trip: the sender reads a and m and writes m; the receiver reads m and writes m and
    its output; the codes are written once and read once."""
    return 6 * 4 + 2 * bits / 8


def quantize_bytes_per_element(bits: int) -> float:
    return 4 + bits / 8  # read x, write the packed codes


def dequantize_bytes_per_element(bits: int) -> float:
    return bits / 8 + 4  # read the packed codes, write x


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _gbps(nbytes: int, seconds: list[float], best: bool = False) -> float:
    """GB/s from the median call (typical) or the fastest call (``best``: least disturbed by other load)."""
    return nbytes / (min(seconds) if best else statistics.median(seconds)) / 1e9


def bench_delta(
    bits: int,
    rows: int,
    cols: int,
    examples: int,
    microbatches: int,
    epochs: int,
    seed: int,
    device: torch.device | None = None,
) -> dict:
    dev = device or torch.device("cpu")
    gen = torch.Generator().manual_seed(seed)
    per = rows // examples
    acts = [torch.randn(examples, per, cols, generator=gen).to(dev) for _ in range(microbatches)]
    cfg = DeltaConfig(quant=QuantConfig(bits=bits), seed_codec="fp32")
    cfg.buffers.device = str(dev)
    cfg.buffers.device_budget_mb = cfg.buffers.ram_budget_mb = (
        float(8 * rows * cols * microbatches) / 2**20 + 1
    )
    enc, dec = DeltaEncoder(cfg), DeltaDecoder(cfg, device=dev)
    naive = NaiveDelta(bits, dev)
    c_enc, c_dec, c_naive = _Clock(dev), _Clock(dev), _Clock(dev)
    errs: list[float] = []
    naive_errs: list[float] = []
    wire = 0
    for epoch in range(epochs):
        e_err, n_err = [], []
        for i, a in enumerate(acts):
            if epoch:  # 10 % relative change per epoch (untimed)
                change = torch.randn(a.shape, generator=gen).to(dev)
                a.add_(change, alpha=0.1 * float(a.norm() / change.norm()))
            ids = range(i * examples, (i + 1) * examples)
            a_RC = a.view(rows, cols)
            with c_enc:
                packet = enc.encode(a, ids)
            with c_dec:
                out, _ = dec.decode(packet)
            with c_naive:
                nout = naive.decode(i, naive.encode(i, a_RC), a_RC)
            if not epoch:  # the seeding epoch is not part of the steady state
                for clock in (c_enc, c_dec, c_naive):
                    clock.samples.pop()
                continue
            wire = len(packet)
            e_err.append(_rel(out, a))
            n_err.append(_rel(nout, a_RC))
        if epoch:
            errs.append(statistics.mean(e_err))
            naive_errs.append(statistics.mean(n_err))
    t_enc, t_dec, t_naive = c_enc.samples, c_dec.samples, c_naive.samples
    nbytes = rows * cols * 4
    round_trip = [e + d for e, d in zip(t_enc, t_dec, strict=True)]  # sender + receiver, same micro-batch
    ours, base = _gbps(nbytes, round_trip), _gbps(nbytes, t_naive)
    ours_best, base_best = _gbps(nbytes, round_trip, True), _gbps(nbytes, t_naive, True)
    n_scales_bits = 16 * cols
    return {
        "gbps": round(ours, 4),
        "encode_gbps": round(_gbps(nbytes, t_enc), 4),
        "decode_gbps": round(_gbps(nbytes, t_dec), 4),
        "baseline_gbps": round(base, 4),
        "ratio_vs_baseline": round(ours / base, 2),
        "ratio_vs_reference": round(ours / REFERENCE_DELTA_GBPS, 1),
        "gbps_best": round(ours_best, 4),
        "baseline_gbps_best": round(base_best, 4),
        "ratio_vs_baseline_best": round(ours_best / base_best, 2),
        "rel_error_per_epoch": [round(e, 5) for e in errs],
        "rel_error": round(errs[-1], 5),
        "baseline_rel_error": round(naive_errs[-1], 5),
        "bits_per_element": round(8 * wire / (rows * cols), 4),
        "baseline_bits_per_element": round((rows * cols * bits + n_scales_bits) / (rows * cols), 4),
        "buffer_bytes_per_side": enc.stats().total_bytes,
        "buffer_device_bytes_per_side": enc.stats().device_bytes,
        "touched_gbps": round(ours * delta_bytes_per_element(bits) / 4, 4),
    }


def bench_direct(
    bits: int, rows: int, cols: int, repeat: int, seed: int, device: torch.device | None = None
) -> dict:
    dev = device or torch.device("cpu")
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(dev)
    codec = make_codec(f"q{bits}")
    absmax = make_codec(f"q{bits}", QuantConfig(scale="absmax"))
    stochastic = make_codec(f"q{bits}", QuantConfig(rounding="stochastic"))
    naive = NaiveQuantizer(bits, dev)
    c_q, c_d, c_s, c_nq, c_nd = (_Clock(dev) for _ in range(5))
    for _ in range(repeat):
        with c_q:
            data, _ = codec.encode(x)
        with c_d:
            y = codec.decode(data, device=dev)
        with c_s:
            stochastic.encode(x)
        with c_nq:
            packed, scale = naive.encode(x)
        with c_nd:
            ny = naive.decode(packed, scale, (rows, cols))
    t_q, t_d, t_s, t_nq, t_nd = (c.samples for c in (c_q, c_d, c_s, c_nq, c_nd))
    nbytes = rows * cols * 4
    ours, base = _gbps(nbytes, t_q), _gbps(nbytes, t_nq)
    ours_best, base_best = _gbps(nbytes, t_q, True), _gbps(nbytes, t_nq, True)
    return {
        "quantize_pack_gbps": round(ours, 4),
        "unpack_dequantize_gbps": round(_gbps(nbytes, t_d), 4),
        "stochastic_quantize_pack_gbps": round(_gbps(nbytes, t_s), 4),
        "baseline_quantize_pack_gbps": round(base, 4),
        "baseline_unpack_dequantize_gbps": round(_gbps(nbytes, t_nd), 4),
        "ratio_vs_baseline": round(ours / base, 2),
        "ratio_vs_reference": round(ours / REFERENCE_QUANTIZE_PACK_GBPS, 1),
        "quantize_pack_gbps_best": round(ours_best, 4),
        "baseline_quantize_pack_gbps_best": round(base_best, 4),
        "ratio_vs_baseline_best": round(ours_best / base_best, 2),
        "rel_error": round(_rel(y, x), 5),
        "rel_error_absmax": round(_rel(absmax.decode(absmax.encode(x)[0], device=dev), x), 5),
        "baseline_rel_error": round(_rel(ny, x), 5),
        "bits_per_element": round(8 * len(data) / x.numel(), 4),
        "quantize_pack_touched_gbps": round(ours * quantize_bytes_per_element(bits) / 4, 4),
        "unpack_dequantize_touched_gbps": round(
            _gbps(nbytes, t_d) * dequantize_bytes_per_element(bits) / 4, 4
        ),
    }


@click.command()
@click.option("--rows", default=1024, show_default=True, help="Rows (tokens of a micro-batch).")
@click.option("--cols", default=4096, show_default=True, help="Columns (hidden channels).")
@click.option(
    "--examples", default=8, show_default=True, help="Examples per micro-batch (rows split evenly)."
)
@click.option("--microbatches", default=4, show_default=True, help="Distinct micro-batches cycled per epoch.")
@click.option("--epochs", default=6, show_default=True, help="Epochs (the first seeds the buffers, untimed).")
@click.option("--bits", default="2,3,4,8", show_default=True, help="Comma-separated code widths.")
@click.option("--repeat", default=10, show_default=True, help="Timed rounds of the direct quantizer.")
@click.option(
    "--threads", default=None, type=int, help="torch intra-op threads [default: the CPUs available]."
)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="Where the codecs and the baseline run: cpu, cuda, cuda:N or mps (tensors, scratch and AC-SGD "
    "buffers live there; the wire bytes are copied to the host as in training).",
)
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Also write the JSON here.")
def command(rows, cols, examples, microbatches, epochs, bits, repeat, threads, seed, device, out) -> None:
    """AC-SGD delta round trip and direct quantization vs a multi-pass torch baseline (JSON).

    Also reports each codec against the device's memory-bandwidth roofline, measured in the same run.
    """
    try:
        dev = resolve_bench_device(device)
    except ConfigError as exc:
        raise click.BadParameter(exc.detail, param_hint="--device") from None
    if rows % examples:
        raise click.BadParameter("rows must be a multiple of examples", param_hint="--rows")
    if epochs < 2:
        raise click.BadParameter("at least 2 epochs (the first one seeds)", param_hint="--epochs")
    widths = [int(b) for b in bits.split(",")]
    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    result: dict = {
        "config": {
            "rows": rows, "cols": cols, "examples_per_microbatch": examples, "microbatches": microbatches,
            "epochs": epochs, "threads": threads, "torch": torch.__version__, "change_per_epoch": 0.1,
            "device": str(dev), "device_name": _device_name(dev),
        },
        "reference": REFERENCE,
        "bits": {},
    }  # fmt: skip
    bandwidth = memory_bandwidth_gbps(dev, nbytes=min(1 << 30, max(64 << 20, 16 * rows * cols * 4)))
    result["roofline"] = {
        "memory_bandwidth_gbps": round(bandwidth, 2),
        "how": "median read + write GB/s of a device-to-device copy, measured in this run",
        "bytes_per_element": {
            "delta_round_trip": "6 x 4 (sender reads a, m and writes m; receiver reads m, writes m and "
            "its output) + 2 x bits/8 (codes written and read)",
            "quantize_pack": "4 + bits/8",
            "unpack_dequantize": "bits/8 + 4",
        },
    }
    for b in widths:
        delta = bench_delta(b, rows, cols, examples, microbatches, epochs, seed + b, dev)
        direct = bench_direct(b, rows, cols, repeat, seed + b, dev)
        delta["roofline_fraction"] = round(delta["touched_gbps"] / bandwidth, 4)
        direct["quantize_pack_roofline_fraction"] = round(direct["quantize_pack_touched_gbps"] / bandwidth, 4)
        direct["unpack_dequantize_roofline_fraction"] = round(
            direct["unpack_dequantize_touched_gbps"] / bandwidth, 4
        )
        result["bits"][str(b)] = {"delta": delta, "direct": direct}
    emit_json(result, out)


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return dev.type
