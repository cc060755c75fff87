"""AC-SGD buffer state: saved and restored through real files (spill files included), sides resume bit-identical."""

from __future__ import annotations

import io
import os

import pytest
import torch

from peerd.compress import BufferConfig, BufferStore, DeltaConfig, DeltaDecoder, DeltaEncoder, QuantConfig
from peerd.compress.wire import CODEC_DELTA, parse_packet
from peerd.errors import CodecError, ConfigError, ErrorCode

EX = (8, 16)  # per-example shape (tokens, hidden)
EXAMPLE_MB = EX[0] * EX[1] * 4 / 2**20


def _through_file(state: dict) -> dict:
    """What a checkpoint file gives back (torch.save, then a weights-only load, as checkpoint.load does)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def _rows(store: BufferStore) -> dict[int, torch.Tensor]:
    return {i: store.get(i).clone() for i in store.ids()}


def _same(a: BufferStore, b: BufferStore) -> bool:
    ra, rb = _rows(a), _rows(b)
    return ra.keys() == rb.keys() and all(
        ra[i].dtype == rb[i].dtype and torch.equal(ra[i], rb[i]) for i in ra
    )


def _train(enc: DeltaEncoder, dec: DeltaDecoder, x: torch.Tensor, order: list[int], b: int = 4) -> None:
    for s in range(0, len(order), b):
        ids = order[s : s + b]
        dec.decode(enc.encode(x[ids], ids))


@pytest.mark.parametrize("storage", ["float32", "float16", "bfloat16"])
def test_resumed_pair_continues_exactly_like_the_uninterrupted_one(tmp_path, storage: str):
    n = 20
    # 6 examples in RAM, the rest in memory-mapped spill files: the state must carry both
    buffers = BufferConfig(
        ram_budget_mb=EXAMPLE_MB * 6, spill_dir=str(tmp_path / "a"), chunk_examples=4, storage=storage
    )
    cfg = DeltaConfig(quant=QuantConfig(bits=3), buffers=buffers)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, *EX, generator=gen)
    enc, dec = DeltaEncoder(cfg), DeltaDecoder(cfg)
    for _ in range(2):
        x += 0.1 * torch.randn(n, *EX, generator=gen)
        _train(enc, dec, x, torch.randperm(n, generator=gen).tolist())
    enc.invalidate([3, 7])  # freed rows: partly used chunks in the state
    dec.invalidate([3, 7])
    assert enc.stats().spill_files > 0
    sent_state, recv_state = _through_file(enc.state_dict()), _through_file(dec.state_dict())

    cfg2 = DeltaConfig(
        quant=QuantConfig(bits=3), buffers=BufferConfig(**{**vars(buffers), "spill_dir": str(tmp_path / "b")})
    )
    enc2, dec2 = DeltaEncoder(cfg2), DeltaDecoder(cfg2)
    enc2.load_state_dict(sent_state)
    dec2.load_state_dict(recv_state)
    assert _same(enc2.store, enc.store) and _same(dec2.store, dec.store) and _same(enc2.store, dec2.store)
    assert enc2.stats().examples == n - 2 and enc2.stats().spill_files > 0
    assert all(enc2.store.visits(i) == enc.store.visits(i) for i in range(n))

    # the next epoch: identical packets, identical outputs, and deltas from the first visit on
    x += 0.1 * torch.randn(n, *EX, generator=gen)
    order = torch.randperm(n, generator=gen).tolist()
    for s in range(0, n, 4):
        ids = order[s : s + 4]
        packet = enc.encode(x[ids], ids)
        assert enc2.encode(x[ids], ids) == packet
        out, _ = dec.decode(packet)
        out2, _ = dec2.decode(packet)
        assert torch.equal(out, out2)
        delta_ids = {
            i for f in parse_packet(packet)[1] if f.header.codec == CODEC_DELTA for i in f.header.ids
        }
        assert delta_ids == set(ids) - {3, 7}
    assert _same(enc2.store, dec2.store) and _same(enc.store, enc2.store)
    for c in (enc, dec, enc2, dec2):
        c.close()
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == []


def test_either_side_state_seeds_the_other_and_ids_use_64_bits():
    cfg = DeltaConfig()
    enc, dec = DeltaEncoder(cfg), DeltaDecoder(cfg)
    ids = [0, 2**63 + 5, 2**64 - 1]
    x = torch.randn(3, *EX)
    dec.decode(enc.encode(x, ids))
    fresh = DeltaDecoder(cfg)
    fresh.load_state_dict(_through_file(enc.state_dict()))  # a replacement receiver from the sender's state
    packet = enc.encode(x * 1.01, ids)
    assert torch.equal(fresh.decode(packet)[0], dec.decode(packet)[0])
    assert sorted(fresh.store.ids()) == ids


def test_empty_state_round_trips_and_loading_replaces_everything():
    cfg = DeltaConfig()
    enc = DeltaEncoder(cfg)
    empty = _through_file(enc.state_dict())
    enc.encode(torch.randn(2, *EX), [1, 2])
    enc.load_state_dict(empty)
    assert len(enc.store) == 0 and enc.store.example_shape is None and enc.store.visits(1) == 0


def test_bad_states_are_refused_and_leave_the_store_empty():
    cfg = DeltaConfig()
    enc = DeltaEncoder(cfg)
    enc.encode(torch.randn(4, *EX), [0, 1, 2, 3])
    good = _through_file(enc.state_dict())
    target = DeltaDecoder(cfg)
    with pytest.raises(CodecError) as info:
        target.load_state_dict({"buffers": {**good["buffers"], "format": 99}})
    assert info.value.code == ErrorCode.MALFORMED
    bad_rows = {**good["buffers"], "chunks": [{"ids": torch.tensor([0, 1], dtype=torch.uint64),
                                               "rows": torch.zeros(3, *EX)}]}  # fmt: skip
    with pytest.raises(CodecError):
        target.load_state_dict({"buffers": bad_rows})
    assert len(target.store) == 0
    small = DeltaDecoder(DeltaConfig(buffers=BufferConfig(ram_budget_mb=EXAMPLE_MB * 2, disk_budget_mb=0)))
    with pytest.raises(ConfigError):
        small.load_state_dict(good)  # budgets for 2 examples, the state has 4
    assert len(small.store) == 0
    with pytest.raises(CodecError):
        target.load_state_dict({"nothing": 1})
