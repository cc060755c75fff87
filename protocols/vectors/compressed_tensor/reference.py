"""Pure-Python reference of protocols/compressed-tensor.md (no torch, no peerd), and the vector generator.

Written from the spec, element by element, so the vectors check peerd's vectorised torch
implementation against an independent one. Run ``python reference.py`` to rewrite the
vectors next to it. Encoder: ``absmax`` clip, nearest rounding (the rms clip depends on
float summation order, so vectors do not pin it).
"""

from __future__ import annotations

import json
import math
import random
import struct
from fractions import Fraction
from pathlib import Path

DTYPE_IDS = {"float32": 1, "float16": 2, "bfloat16": 3}
WIDTH = {"float32": 32, "float16": 16, "bfloat16": 16}
RAW_CODECS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
TINY = 2.0**-116


# -- number formats ---------------------------------------------------------------------
def f32(x: float) -> float:
    """Round a double to the nearest binary32 (ties to even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def bf16(x: float) -> float:
    """binary32 -> bfloat16, round to nearest even."""
    b = f32_bits(f32(x))
    lsb = (b >> 16) & 1
    return from_bits(((b + 0x7FFF + lsb) >> 16) << 16 & 0xFFFFFFFF)


def f16(x: float) -> float:
    return struct.unpack("<e", struct.pack("<e", f32(x)))[0]


def to_dtype(x: float, dtype: str) -> float:
    return {"float32": f32, "float16": f16, "bfloat16": bf16}[dtype](x)


def dtype_bytes(x: float, dtype: str) -> bytes:
    if dtype == "float32":
        return struct.pack("<f", x)
    if dtype == "float16":
        return struct.pack("<e", x)
    return struct.pack("<H", f32_bits(x) >> 16)


def round_up_scale(s: float, scale_dtype: str) -> float:
    drop = 0xFFFF if scale_dtype == "bfloat16" else 0xFF
    return from_bits((f32_bits(s) + drop) & ~drop & 0xFFFFFFFF)


# -- layouts and packing ------------------------------------------------------------------
def numel(shape: list[int]) -> int:
    return math.prod(shape)


def scale_index(i: int, shape: list[int], layout: str, group: int) -> int:
    if layout == "channel":
        return i % (shape[-1] if shape else 1)
    return i // group


def n_scales(shape: list[int], layout: str, group: int) -> int:
    if layout == "channel":
        return shape[-1] if shape else 1
    return -(-numel(shape) // group)


def planes(bits: int) -> int:
    return {2: 4, 3: 8, 4: 2, 8: 1}[bits]


def pack(codes: list[int], bits: int) -> bytes:
    g = planes(bits)
    p = -(-len(codes) // g)
    padded = codes + [0] * (g * p - len(codes))
    nbytes = 3 if bits == 3 else 1
    out = bytearray(p * nbytes)
    for t in range(p):
        v = 0
        for j in range(g):
            v |= padded[j * p + t] << (bits * j)
        for r in range(nbytes):
            out[r * p + t] = (v >> (8 * r)) & 0xFF
    return bytes(out)


def unpack(data: bytes, bits: int, n: int) -> list[int]:
    g = planes(bits)
    p = -(-n // g)
    nbytes = 3 if bits == 3 else 1
    codes = []
    for j in range(g):
        for t in range(p):
            v = sum(data[r * p + t] << (8 * r) for r in range(nbytes))
            codes.append((v >> (bits * j)) & ((1 << bits) - 1))
    return codes[:n]


# -- encoder / decoder ----------------------------------------------------------------------
def header(
    codec: int, bits: int, dtype: str, flags: int, layout: int, aux: int, shape, group: int, ids
) -> bytes:
    out = struct.pack(
        "<2sBBBBBBBBHII",
        b"PT",
        1,
        codec,
        bits,
        DTYPE_IDS[dtype],
        flags,
        layout,
        aux,
        len(shape),
        0,
        group,
        len(ids),
    )
    return out + struct.pack(f"<{len(shape)}I", *shape) + struct.pack(f"<{len(ids)}Q", *ids)


def encode_raw(values, shape, dtype: str, payload: str, ids=(), seed=False) -> tuple[bytes, list[float]]:
    sent = [to_dtype(v, payload) for v in values]
    data = header(1, WIDTH[payload], dtype, 2 if seed else 0, 0, DTYPE_IDS[payload], shape, 0, ids)
    data += b"".join(dtype_bytes(v, payload) for v in sent)
    return data, sent


def quantize(values, shape, q: dict) -> tuple[list[int], list[float]]:
    """Codes and scales (absmax clip, nearest rounding) of binary32 ``values``."""
    bits, layout, group, sym = q["bits"], q["layout"], q.get("group_size", 0), q["symmetric"]
    L = 2**bits
    amax = [0.0] * n_scales(shape, layout, group)
    for i, v in enumerate(values):
        j = scale_index(i, shape, layout, group)
        amax[j] = max(amax[j], abs(v))
    reach = L / 2 if sym else L / 2 - 0.5
    scales, steps = [], []
    for a in amax:
        step = f32(a / reach)
        s = round_up_scale(f32(step * 0.5) if sym else step, q["scale_dtype"])
        if a < TINY:
            s = 0.0
        scales.append(s)
        steps.append(f32(2 * s) if sym else s)
    off = Fraction(L // 2) if sym else Fraction(L, 2) + Fraction(1, 2)
    codes = []
    for i, v in enumerate(values):
        step = steps[scale_index(i, shape, layout, group)]
        inv = f32(1.0 / step) if step > 0 else 0.0
        y = Fraction(v) * Fraction(inv) + off  # exact; vectors keep y away from integers (see check_margin)
        codes.append(min(max(math.floor(y), 0), L - 1))
    return codes, scales


def levels(codes: list[int], bits: int, sym: bool) -> list[int]:
    L = 2**bits
    return [2 * c - (L - 1) if sym else c - L // 2 for c in codes]


def encode_uniform(values, shape, dtype: str, q: dict, codec: int = 2, ids=(), seed=False):
    codes, scales = quantize(values, shape, q)
    layout = 1 if q["layout"] == "channel" else 2
    aux = DTYPE_IDS[q["scale_dtype"]]
    flags = (1 if q["symmetric"] else 0) | (2 if seed else 0)
    group = q.get("group_size", 0) if q["layout"] == "group" else 0
    data = header(codec, q["bits"], dtype, flags, layout, aux, shape, group, ids)
    data += b"".join(dtype_bytes(s, q["scale_dtype"]) for s in scales)
    data += pack(codes, q["bits"])
    k = levels(codes, q["bits"], q["symmetric"])
    recon = [f32(k[i] * scales[scale_index(i, shape, q["layout"], group)]) for i in range(len(values))]
    return data, recon


def check_margin(values, shape, q: dict, margin: float = 1e-3) -> bool:
    """Whether every value's ``x * inv + o`` either is exact in binary32 or lies ``margin`` away from an integer.

    Then any binary32 evaluation order (fused or not) floors to the same code.
    """
    _, scales = quantize(values, shape, q)
    sym, L = q["symmetric"], 2 ** q["bits"]
    group = q.get("group_size", 0)
    off = Fraction(L // 2) if sym else Fraction(L, 2) + Fraction(1, 2)
    for i, v in enumerate(values):
        s = scales[scale_index(i, shape, q["layout"], group)]
        step = f32(2 * s) if sym else s
        if step == 0:
            continue
        inv = f32(1.0 / step)
        y = Fraction(v) * Fraction(inv) + off
        exact = (
            Fraction(f32(v * inv)) == Fraction(v) * Fraction(inv)
            and Fraction(f32(f32(v * inv) + float(off))) == y
        )
        if not exact and 0 < y < L and abs(y - round(y)) < margin:
            return False
    return True


# -- vector generation ----------------------------------------------------------------------
def _values(rng: random.Random, shape, q, amaxes=None, dtype: str = "float32") -> list[float]:
    """Random values of ``dtype``, each channel/group with a chosen amax, kept off rounding boundaries."""
    for _ in range(1000):
        vals = [
            to_dtype(
                rng.uniform(-1, 1)
                * (amaxes[scale_index(i, shape, q["layout"], q.get("group_size", 0))] if amaxes else 1),
                dtype,
            )
            for i in range(numel(shape))
        ]
        if amaxes:  # pin each scale's amax exactly
            for j, a in enumerate(amaxes):
                idx = [
                    i
                    for i in range(len(vals))
                    if scale_index(i, shape, q["layout"], q.get("group_size", 0)) == j
                ]
                if idx:
                    vals[idx[0]] = f32(a if j % 2 else -a)
        if check_margin(vals, shape, q):
            return vals
    raise RuntimeError("could not draw values away from rounding boundaries")


def frame_case(name, desc, codec, q, dtype, shape, values, ids=(), seed=False) -> dict:
    vals = [to_dtype(v, dtype) for v in values]
    if codec in RAW_CODECS:
        data, recon = encode_raw(vals, shape, dtype, RAW_CODECS[codec], ids, seed)
    else:
        data, recon = encode_uniform(vals, shape, dtype, q, ids=ids, seed=seed)
    case = {
        "description": desc,
        "kind": "frame",
        "codec": codec,
        "input": {"dtype": dtype, "shape": shape, "values": vals},
    }
    if q:
        case["quant"] = q
    if ids:
        case["input"]["ids"] = list(ids)
        case["input"]["seed"] = seed
    case["frame_hex"] = data.hex()
    case["decoded"] = [to_dtype(v, dtype) for v in recon]
    return name, case


def packet(ids, frames: list[bytes]) -> bytes:
    out = struct.pack("<2sBBI", b"PK", 1, len(frames), len(ids)) + struct.pack(f"<{len(ids)}Q", *ids)
    return out + b"".join(struct.pack("<I", len(f)) + f for f in frames)


def acsgd_case(rng: random.Random) -> tuple[str, dict]:
    """Two micro-batches: seeds for ids 7 and 3, then deltas for 3 and 7 plus a seed for new id 9."""
    q = {"bits": 4, "layout": "channel", "symmetric": True, "scale": "absmax", "scale_dtype": "bfloat16"}
    ex_shape = [2, 3]
    buffers: dict[int, list[float]] = {}
    steps = []
    step1 = {7: [f32(rng.uniform(-2, 2)) for _ in range(6)], 3: [f32(rng.uniform(-2, 2)) for _ in range(6)]}
    frame, recon = encode_raw(
        step1[7] + step1[3], [2, *ex_shape], "float32", "float32", ids=(7, 3), seed=True
    )
    buffers[7], buffers[3] = recon[:6], recon[6:]
    steps.append(
        {
            "input": {"ids": [7, 3], "values": step1[7] + step1[3]},
            "packet_hex": packet([7, 3], [frame]).hex(),
            "decoded": recon,
            "buffers": {str(k): v for k, v in sorted(buffers.items())},
        }
    )
    for _ in range(1000):  # step 2: a = old + change; delta rows 3, 7 (row order), seed row 9
        a = {i: [f32(v + rng.uniform(-0.3, 0.3)) for v in buffers[i]] for i in (3, 7)}
        delta = [f32(x - m) for i in (3, 7) for x, m in zip(a[i], buffers[i], strict=True)]
        if check_margin(delta, [2, *ex_shape], q):
            break
    a[9] = [f32(rng.uniform(-2, 2)) for _ in range(6)]
    seed_frame, seed_recon = encode_raw(a[9], [1, *ex_shape], "float32", "float32", ids=(9,), seed=True)
    delta_frame, d_recon = encode_uniform(delta, [2, *ex_shape], "float32", q, codec=3, ids=(3, 7))
    buffers[9] = seed_recon
    for r, i in enumerate((3, 7)):
        buffers[i] = [f32(m + d) for m, d in zip(buffers[i], d_recon[6 * r : 6 * r + 6], strict=True)]
    order = [3, 9, 7]
    steps.append(
        {
            "input": {"ids": order, "values": [v for i in order for v in a[i]]},
            "packet_hex": packet(order, [seed_frame, delta_frame]).hex(),
            "decoded": [v for i in order for v in buffers[i]],
            "buffers": {str(k): v for k, v in sorted(buffers.items())},
        }
    )
    case = {
        "description": "AC-SGD: first visits seed fp32 buffers; then a 4-bit delta frame for the known ids and a seed for a new one",
        "kind": "packets",
        "delta": {"quant": q, "seed_codec": "fp32", "warmup_visits": 1},
        "example_shape": ex_shape,
        "steps": steps,
    }
    return "packets-acsgd-seed-then-delta", case


def error_cases(valid: dict[str, dict]) -> list[tuple[str, dict]]:
    base = bytes.fromhex(valid["q4-channel-symmetric"]["frame_hex"])
    raw = bytes.fromhex(valid["raw-fp32"]["frame_hex"])

    def patch(data: bytes, offset: int, new: bytes) -> str:
        return (data[:offset] + new + data[offset + len(new) :]).hex()

    nan_scale = bytearray(base)
    nan_scale[20 + 4 * 2 : 20 + 4 * 2 + 2] = b"\xc0\x7f"  # first bf16 scale := NaN
    nan_raw = bytearray(raw)
    nan_raw[-4:] = struct.pack("<f", math.nan)
    cases = [
        ("bad-magic", "wrong magic", "MALFORMED", patch(base, 0, b"PX")),
        ("bad-version", "version 2", "UNSUPPORTED_VERSION", patch(base, 2, b"\x02")),
        ("bad-codec", "codec id 9", "UNKNOWN_CODEC", patch(base, 3, b"\x09")),
        ("bad-bits", "5-bit codes", "UNSUPPORTED_BITS", patch(base, 4, b"\x05")),
        (
            "bad-raw-bits",
            "raw float32 payload announced as 16-bit",
            "UNSUPPORTED_BITS",
            patch(raw, 4, b"\x10"),
        ),
        ("bad-dtype", "dtype id 7", "DTYPE_MISMATCH", patch(base, 5, b"\x07")),
        ("bad-flags", "unknown flag bit", "MALFORMED", patch(base, 6, b"\x81")),
        ("bad-layout", "layout 5", "MALFORMED", patch(base, 7, b"\x05")),
        ("bad-group-zero", "group layout with group size 0", "MALFORMED", patch(base, 7, b"\x02")),
        ("bad-truncated-header", "cut inside the header", "TRUNCATED", base[:15].hex()),
        ("bad-truncated-payload", "last payload byte missing", "TRUNCATED", base[:-1].hex()),
        ("bad-trailing", "one byte after the frame", "MALFORMED", (base + b"\x00").hex()),
        (
            "bad-ids-count",
            "one id for a 4-row tensor",
            "SHAPE_MISMATCH",
            patch(base, 16, struct.pack("<I", 1)),
        ),
        ("bad-scale-nan", "a NaN scale", "NON_FINITE", bytes(nan_scale).hex()),
        ("bad-raw-nan", "a NaN raw value", "NON_FINITE", bytes(nan_raw).hex()),
    ]
    out = [(n, {"description": d, "kind": "frame", "error": e, "frame_hex": h}) for n, d, e, h in cases]
    pk = valid["packets-acsgd-seed-then-delta"]["steps"]
    first, second = bytes.fromhex(pk[0]["packet_hex"]), bytes.fromhex(pk[1]["packet_hex"])
    out += [
        (
            "bad-packet-truncated",
            {
                "description": "packet cut inside its second frame",
                "kind": "packets",
                "error": "TRUNCATED",
                "packet_hex": second[:-3].hex(),
            },
        ),
        (
            "bad-packet-ids",
            {
                "description": "packet ids not covered by its frames",
                "kind": "packets",
                "error": "MALFORMED",
                "packet_hex": patch(second, 8, struct.pack("<Q", 5)),
            },
        ),
        (
            "bad-packet-unknown-example",
            {
                "description": "delta for ids the receiver never saw seeded",
                "kind": "packets",
                "error": "UNKNOWN_EXAMPLE",
                "packet_hex": second.hex(),
            },
        ),
        (
            "bad-packet-shape",
            {
                "description": "delta rows with another example shape than the buffers",
                "kind": "packets",
                "error": "SHAPE_MISMATCH",
                "state": [first.hex()],
                "packet_hex": _reshape_delta(second).hex(),
            },
        ),
    ]
    return out


def _reshape_delta(pk: bytes) -> bytes:
    """The step-2 packet with only its delta frame, relabelled as shape (2, 1, 2, 3) instead of (2, 2, 3)."""
    n = struct.unpack_from("<I", pk, 4)[0]
    off = 8 + 8 * n
    frames = []
    for _ in range(pk[3]):
        (length,) = struct.unpack_from("<I", pk, off)
        frames.append(pk[off + 4 : off + 4 + length])
        off += 4 + length
    delta = frames[1]
    fields = list(struct.unpack_from("<2sBBBBBBBBHII", delta))
    ids = list(struct.unpack_from("<2Q", delta, 20 + 12))
    fields[8] = 4  # ndim
    head = struct.pack("<2sBBBBBBBBHII", *fields) + struct.pack("<4I", 2, 1, 2, 3) + struct.pack("<2Q", *ids)
    return packet(ids, [head + delta[20 + 12 + 16 :]])


def generate() -> dict[str, dict]:
    rng = random.Random(20240604)
    sym4 = {"bits": 4, "layout": "channel", "symmetric": True, "scale": "absmax", "scale_dtype": "bfloat16"}
    zero2 = {
        "bits": 2,
        "layout": "group",
        "group_size": 4,
        "symmetric": False,
        "scale": "absmax",
        "scale_dtype": "float32",
    }
    sym3 = {"bits": 3, "layout": "channel", "symmetric": True, "scale": "absmax", "scale_dtype": "bfloat16"}
    sym8 = {
        "bits": 8,
        "layout": "group",
        "group_size": 4,
        "symmetric": True,
        "scale": "absmax",
        "scale_dtype": "float32",
    }
    zero4 = {"bits": 4, "layout": "channel", "symmetric": False, "scale": "absmax", "scale_dtype": "bfloat16"}
    cases = dict(
        [
            frame_case(
                "raw-fp32",
                "raw float32, no ids",
                "fp32",
                None,
                "float32",
                [2, 3],
                [f32(rng.uniform(-4, 4)) for _ in range(6)],
            ),
            frame_case(
                "raw-fp16-payload",
                "float32 tensor sent as float16 values",
                "fp16",
                None,
                "float32",
                [5],
                [f32(rng.uniform(-100, 100)) for _ in range(5)],
            ),
            frame_case(
                "raw-bf16-seed",
                "bfloat16 payload, SEED with ids",
                "bf16",
                None,
                "float32",
                [2, 2],
                [f32(rng.uniform(-1, 1)) for _ in range(4)],
                ids=(11, 2**40 + 3),
                seed=True,
            ),
            # amax 1 + 2^-10 per column: the scale amax/16 needs rounding up to bfloat16 (the division is exact)
            frame_case(
                "q4-channel-symmetric",
                "4-bit symmetric grid, per-channel bf16 scales rounded up",
                "q4",
                sym4,
                "float32",
                [4, 3],
                _values(rng, [4, 3], sym4, [f32(1 + 2**-10), 0.5, f32(3 * 2**-20)]),
            ),
            frame_case(
                "q2-group-zero-grid",
                "2-bit zero grid, groups of 4 with a short last group, fp32 scales",
                "q2",
                zero2,
                "float32",
                [10],
                _values(rng, [10], zero2, [3.0, 0.75, 1.5]),
            ),
            frame_case(
                "q3-channel-odd-size",
                "3-bit planar packing of 21 codes (padding)",
                "q3",
                sym3,
                "float32",
                [3, 7],
                _values(rng, [3, 7], sym3, [1.0, 2.0, 0.25, 4.0, 1.0, 0.5, 8.0]),
            ),
            frame_case(
                "q8-group-symmetric",
                "8-bit symmetric (levels up to +-255), fp32 scales",
                "q8",
                sym8,
                "float32",
                [2, 4],
                _values(rng, [2, 4], sym8, [1.0, 64.0]),
            ),
            frame_case(
                "q4-zero-grid-bf16-tensor",
                "bfloat16 tensor, 4-bit zero grid; decodes to bfloat16",
                "q4",
                zero4,
                "bfloat16",
                [3, 2],
                _values(rng, [3, 2], zero4, [7.5, 0.9375], "bfloat16"),
            ),
            frame_case(
                "q4-zero-channel",
                "a channel of zeros and a tiny one (scale 0 below 2^-116)",
                "q4",
                sym4,
                "float32",
                [2, 2],
                [0.0, 1e-36, 0.0, -1e-36],
            ),
            acsgd_case(rng),
        ]
    )
    cases.update(error_cases(cases))
    return cases


def main() -> None:
    here = Path(__file__).resolve().parent
    for old in here.glob("*.json"):
        old.unlink()
    for name, case in generate().items():
        (here / f"{name}.json").write_text(json.dumps(case, indent=1) + "\n")
    print(f"wrote {len(list(here.glob('*.json')))} vectors to {here}")


if __name__ == "__main__":
    main()
