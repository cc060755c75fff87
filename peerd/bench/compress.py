"""``peerd bench compress``: AC-SGD delta and direct quantization throughput/error vs a multi-pass torch baseline.

Both run side by side in one process on the same data (interleaved call by call, so machine
load hits both alike); the JSON reports GB/s of float32 input from the median call and from
the fastest call (``_best``: least disturbed by other processes), the ratio to the baseline
and to the reference implementation's published 0.047 GB/s, relative L2 errors (direct,
and delta after each epoch of a 10 % per-epoch change) and bits per element on the wire.

The baseline is the straightforward way to write the reference's quantizer in torch:
per-channel absmax fp16 scales with an absolute epsilon, ``round(x / s * 2**(b-1))``
clipped to the asymmetric grid, and bit packing through an 8x-expanded bit array.
"""

from __future__ import annotations

import os
import statistics
import time

import click
import torch

from peerd.bench import emit_json
from peerd.compress import DeltaConfig, DeltaDecoder, DeltaEncoder, QuantConfig, make_codec

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

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.half = 2 ** (bits - 1)
        self.shift_b = torch.arange(bits, dtype=torch.uint8)
        self.shift_8 = torch.arange(8, dtype=torch.uint8)

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

    def __init__(self, bits: int) -> None:
        self.q = NaiveQuantizer(bits)
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
    """Accumulates wall times of the blocks it wraps: ``with clock: ...`` appends one sample."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    def __enter__(self) -> _Clock:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.samples.append(time.perf_counter() - self._t0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _gbps(nbytes: int, seconds: list[float], best: bool = False) -> float:
    """GB/s from the median call (typical) or the fastest call (``best``: least disturbed by other load)."""
    return nbytes / (min(seconds) if best else statistics.median(seconds)) / 1e9


def bench_delta(
    bits: int, rows: int, cols: int, examples: int, microbatches: int, epochs: int, seed: int
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    per = rows // examples
    acts = [torch.randn(examples, per, cols, generator=gen) for _ in range(microbatches)]
    enc = DeltaEncoder(DeltaConfig(quant=QuantConfig(bits=bits), seed_codec="fp32"))
    dec = DeltaDecoder(DeltaConfig(quant=QuantConfig(bits=bits), seed_codec="fp32"))
    naive = NaiveDelta(bits)
    c_enc, c_dec, c_naive = _Clock(), _Clock(), _Clock()
    errs: list[float] = []
    naive_errs: list[float] = []
    wire = 0
    for epoch in range(epochs):
        e_err, n_err = [], []
        for i, a in enumerate(acts):
            if epoch:  # 10 % relative change per epoch (untimed)
                change = torch.randn(a.shape, generator=gen)
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
    }


def bench_direct(bits: int, rows: int, cols: int, repeat: int, seed: int) -> dict:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    codec = make_codec(f"q{bits}")
    absmax = make_codec(f"q{bits}", QuantConfig(scale="absmax"))
    stochastic = make_codec(f"q{bits}", QuantConfig(rounding="stochastic"))
    naive = NaiveQuantizer(bits)
    c_q, c_d, c_s, c_nq, c_nd = _Clock(), _Clock(), _Clock(), _Clock(), _Clock()
    for _ in range(repeat):
        with c_q:
            data, _ = codec.encode(x)
        with c_d:
            y = codec.decode(data)
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
        "rel_error_absmax": round(_rel(absmax.decode(absmax.encode(x)[0]), x), 5),
        "baseline_rel_error": round(_rel(ny, x), 5),
        "bits_per_element": round(8 * len(data) / x.numel(), 4),
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
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Also write the JSON here.")
def command(rows, cols, examples, microbatches, epochs, bits, repeat, threads, seed, out) -> None:
    """AC-SGD delta round trip and direct quantization vs a multi-pass torch baseline (JSON)."""
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
        },
        "reference": REFERENCE,
        "bits": {},
    }  # fmt: skip
    for b in widths:
        result["bits"][str(b)] = {
            "delta": bench_delta(b, rows, cols, examples, microbatches, epochs, seed + b),
            "direct": bench_direct(b, rows, cols, repeat, seed + b),
        }
    emit_json(result, out)
