"""AC-SGD delta codec: bit-identical buffers, error that shrinks, warm-up, spill to disk, budgets, invalidation, bad input."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from peerd.compress import BufferConfig, DeltaConfig, DeltaDecoder, DeltaEncoder, QuantConfig
from peerd.compress.wire import CODEC_DELTA, CODEC_RAW, parse_packet
from peerd.errors import CodecError, ErrorCode

EX = (16, 32)  # per-example shape (tokens, hidden)


def _pair(cfg: DeltaConfig) -> tuple[DeltaEncoder, DeltaDecoder]:
    return DeltaEncoder(cfg, generator=torch.Generator().manual_seed(0)), DeltaDecoder(cfg)


def _identical(enc: DeltaEncoder, dec: DeltaDecoder) -> bool:
    ids = set(enc.store.ids())
    return ids == set(dec.store.ids()) and all(torch.equal(enc.store.get(i), dec.store.get(i)) for i in ids)


def _kinds(packet: bytes) -> list[tuple[int, bool, tuple[int, ...]]]:
    return [(f.header.codec, f.header.seed, f.header.ids) for f in parse_packet(packet)[1]]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    "cfg",
    [
        DeltaConfig(),
        DeltaConfig(quant=QuantConfig(bits=2, rounding="stochastic"), warmup_visits=2, seed_codec="q8"),
        DeltaConfig(quant=QuantConfig(bits=3, layout="group", group_size=64, symmetric=False)),
        DeltaConfig(
            quant=QuantConfig(bits=8, scale_dtype="float32"), buffers=BufferConfig(storage="float16")
        ),
        DeltaConfig(quant=QuantConfig(bits=4), buffers=BufferConfig(storage="bfloat16"), seed_codec="fp16"),
    ],
    ids=["q4", "q2-stochastic-warmup2-q8seed", "q3-group-zero", "q8-fp16-storage", "q4-bf16-storage"],
)
def test_buffers_stay_bit_identical_over_shuffled_epochs(cfg: DeltaConfig):
    gen = torch.Generator().manual_seed(1)
    n = 24
    base = torch.randn(n, *EX, generator=gen)
    enc, dec = _pair(cfg)
    for epoch in range(5):
        base += 0.1 * torch.randn(n, *EX, generator=gen)  # the model moved
        order = torch.randperm(n, generator=gen).tolist()
        for start in range(0, n, 6):
            ids = order[start : start + 6]
            out, got = dec.decode(enc.encode(base[ids], ids))
            assert list(got) == ids and out.shape == (6, *EX)
            # the receiver's output is its buffer, which is the sender's buffer
            for r, i in enumerate(ids):
                assert torch.equal(out[r], dec.store.get(i).float())
        assert _identical(enc, dec), epoch


def test_first_visit_seeds_then_deltas_and_mixed_batches():
    enc, dec = _pair(DeltaConfig(warmup_visits=2))
    x = torch.randn(4, *EX)
    for _ in range(2):  # the first visit and one warm-up visit go through the seed codec
        packet = enc.encode(x[:2], [0, 1])
        assert _kinds(packet) == [(CODEC_RAW, True, (0, 1))]
        dec.decode(packet)
    packet = enc.encode(x[[2, 0, 3, 1]], [2, 0, 3, 1])
    assert _kinds(packet) == [(CODEC_RAW, True, (2, 3)), (CODEC_DELTA, False, (0, 1))]
    out, ids = dec.decode(packet)
    assert ids == (2, 0, 3, 1)
    assert _rel(out, x[[2, 0, 3, 1]]) < 0.01  # bf16 seeds; 4-bit deltas of a bf16 rounding error
    assert _identical(enc, dec)


@pytest.mark.parametrize("bits,bound", [(2, 0.06), (3, 0.03), (4, 0.015)])
def test_delta_error_with_ten_percent_change_beats_reference(bits: int, bound: float):
    """Reference: ~0.05 / 0.025 / 0.0125 relative error at a 10 % per-epoch change."""
    gen = torch.Generator().manual_seed(bits)
    acts = torch.randn(8, 64, 256, generator=gen)
    enc, dec = _pair(DeltaConfig(quant=QuantConfig(bits=bits), seed_codec="fp32"))
    errs = []
    for _ in range(6):
        out, _ = dec.decode(enc.encode(acts, range(8)))
        errs.append(_rel(out, acts))
        change = torch.randn(acts.shape, generator=gen)
        acts = acts + 0.1 * change * acts.norm() / change.norm()
    assert errs[0] == 0.0  # fp32 seed
    assert max(errs[2:]) < bound, errs  # flat across epochs, below the reference
    assert min(errs[1:]) > bound / 4  # and measuring something real


def test_static_activations_converge_geometrically():
    """a - m after a visit is the last quantization error: re-sending the same a shrinks it each time."""
    acts = torch.randn(4, *EX, generator=torch.Generator().manual_seed(3))
    enc, dec = _pair(DeltaConfig(quant=QuantConfig(bits=2), seed_codec="q4"))
    errs = [_rel(dec.decode(enc.encode(acts, range(4)))[0], acts) for _ in range(6)]
    assert errs[0] > 0.05
    assert all(b < a * 0.7 for a, b in itertools.pairwise(errs)), errs
    assert errs[-1] < errs[0] * 0.1


def test_spill_to_memory_mapped_files(tmp_path):
    per_example_mb = EX[0] * EX[1] * 4 / 2**20
    cfg = DeltaConfig(
        buffers=BufferConfig(ram_budget_mb=per_example_mb * 3, spill_dir=str(tmp_path), chunk_examples=4)
    )
    enc, dec = _pair(cfg)
    x = torch.randn(12, *EX)
    for _ in range(3):
        for s in range(0, 12, 4):
            dec.decode(enc.encode(x[s : s + 4], range(s, s + 4)))
    stats = enc.stats()
    assert stats.examples == 12 and stats.ram_bytes == 3 * stats.example_bytes
    assert stats.disk_bytes >= 9 * stats.example_bytes and stats.spill_files >= 3
    assert len(os.listdir(tmp_path)) == stats.spill_files + dec.stats().spill_files
    assert _identical(enc, dec)
    assert _rel(dec.decode(enc.encode(x[8:12], range(8, 12)))[0], x[8:12]) < 0.01
    enc.close()
    dec.close()
    assert os.listdir(tmp_path) == []


def test_low_precision_storage_halves_the_size():
    x = torch.randn(4, *EX)
    sizes = {}
    for storage in ("float32", "float16"):
        enc, dec = _pair(DeltaConfig(buffers=BufferConfig(storage=storage, chunk_examples=4)))
        dec.decode(enc.encode(x, range(4)))
        sizes[storage] = enc.stats().total_bytes
        assert enc.store.get(0).dtype == {"float32": torch.float32, "float16": torch.float16}[storage]
    assert sizes["float16"] * 2 == sizes["float32"]


def test_full_budgets_send_plain_rows():
    per_example_mb = EX[0] * EX[1] * 4 / 2**20
    cfg = DeltaConfig(
        buffers=BufferConfig(ram_budget_mb=per_example_mb * 2, disk_budget_mb=0, chunk_examples=2)
    )
    enc, dec = _pair(cfg)
    x = torch.randn(3, *EX)
    packet = enc.encode(x, [10, 11, 12])
    assert _kinds(packet) == [(CODEC_RAW, True, (10, 11)), (CODEC_RAW, False, (12,))]
    out, _ = dec.decode(packet)
    assert _rel(out, x) < 0.01 and len(dec.store) == 2 and 12 not in dec.store
    assert _kinds(enc.encode(x, [10, 11, 12]))[-1] == (CODEC_DELTA, False, (10, 11))


def test_a_total_budget_bounds_every_tier_and_sides_with_different_tiers_agree():
    """One side spills beyond 1 example of RAM, the other holds 3 in RAM: the same total (3) bounds both."""
    per_example_mb = EX[0] * EX[1] * 4 / 2**20
    sender = BufferConfig(ram_budget_mb=per_example_mb, total_budget_mb=per_example_mb * 3, chunk_examples=1)
    receiver = BufferConfig(ram_budget_mb=per_example_mb * 3, total_budget_mb=per_example_mb * 3)
    enc = DeltaEncoder(DeltaConfig(buffers=sender), generator=torch.Generator().manual_seed(0))
    dec = DeltaDecoder(DeltaConfig(buffers=receiver))
    x = torch.randn(5, *EX)
    packet = enc.encode(x, range(5))
    assert _kinds(packet) == [(CODEC_RAW, True, (0, 1, 2)), (CODEC_RAW, False, (3, 4))]
    out, _ = dec.decode(packet)
    assert _rel(out, x) < 0.01 and len(enc.store) == len(dec.store) == 3 and enc.store.room() == 0
    assert enc.stats().spill_files == 2 and dec.stats().spill_files == 0
    again = enc.encode(x, range(5))
    assert _kinds(again)[-1] == (CODEC_DELTA, False, (0, 1, 2))
    dec.decode(again)
    assert _identical(enc, dec)
    enc.close()
    dec.close()


def test_invalidation_starts_over():
    enc, dec = _pair(DeltaConfig())
    x = torch.randn(3, *EX)
    for _ in range(2):
        dec.decode(enc.encode(x, [1, 2, 3]))
    enc.invalidate([2])
    dec.invalidate([2])
    assert _kinds(enc.encode(x, [1, 2, 3]))[0] == (CODEC_RAW, True, (2,))
    enc.invalidate()
    assert _kinds(enc.encode(x, [1, 2, 3])) == [(CODEC_RAW, True, (1, 2, 3))]
    assert enc.stats().examples == 3


def test_receiver_without_buffers_rejects_deltas_and_stays_unchanged():
    enc, dec = _pair(DeltaConfig())
    x = torch.randn(2, *EX)
    dec.decode(enc.encode(x, [1, 2]))
    packet = enc.encode(x, [1, 2])
    dec.invalidate([2])
    before = dec.store.get(1).clone()
    with pytest.raises(CodecError) as info:
        dec.decode(packet)
    assert info.value.code == ErrorCode.UNKNOWN_EXAMPLE
    assert torch.equal(dec.store.get(1), before)


def test_rejected_input_leaves_both_sides_unchanged():
    enc, dec = _pair(DeltaConfig())
    x = torch.randn(3, *EX)
    dec.decode(enc.encode(x, [1, 2, 3]))
    bad = x.clone()
    bad[1, 3, 4] = float("nan")
    snapshot = {i: enc.store.get(i).clone() for i in (1, 2, 3)}
    for ids in ([1, 2, 3], [1, 2, 9]):  # all deltas; deltas plus a seed row
        with pytest.raises(CodecError) as info:
            enc.encode(bad, ids)
        assert info.value.code == ErrorCode.NON_FINITE
        assert 9 not in enc.store and all(torch.equal(enc.store.get(i), t) for i, t in snapshot.items())
        assert enc.store.visits(1) == 1
    dec.decode(enc.encode(x * 1.1, [1, 2, 3]))
    assert _identical(enc, dec)


def test_bad_shapes_and_ids():
    enc, _dec = _pair(DeltaConfig())
    enc.encode(torch.randn(2, *EX), [1, 2])
    cases = [
        (torch.randn(2, 16, 31), [3, 4], ErrorCode.SHAPE_MISMATCH),
        (torch.randn(2, *EX), [3], ErrorCode.SHAPE_MISMATCH),
        (torch.randn(2, *EX), [3, 3], ErrorCode.MALFORMED),
        (torch.randn(2, *EX), [3, -1], ErrorCode.MALFORMED),
    ]
    for acts, ids, code in cases:
        with pytest.raises(CodecError) as info:
            enc.encode(acts, ids)
        assert info.value.code == code
    grouped = DeltaEncoder(DeltaConfig(quant=QuantConfig(layout="group", group_size=100)))
    with pytest.raises(CodecError) as info:
        grouped.encode(torch.randn(2, *EX), [1, 2])
    assert info.value.code == ErrorCode.SHAPE_MISMATCH


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sender_cpu_receiver_stay_identical():
    enc, dec = DeltaEncoder(DeltaConfig()), DeltaDecoder(DeltaConfig(), device="cpu")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, *EX, generator=gen)
    for _ in range(4):
        x += 0.1 * torch.randn(x.shape, generator=gen)
        out, _ = dec.decode(enc.encode(x.cuda(), range(8)))
        assert _rel(out, x) < 0.05
    assert _identical(enc, dec)
