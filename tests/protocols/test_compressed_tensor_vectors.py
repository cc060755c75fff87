"""peerd.compress against the byte-exact vectors in protocols/vectors/compressed_tensor/ (encode, decode, errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from peerd.compress import DeltaConfig, DeltaDecoder, DeltaEncoder, QuantConfig, make_codec
from peerd.compress.wire import DTYPE_NAMES
from peerd.errors import CodecError, ErrorCode

VECTORS = Path(__file__).resolve().parents[2] / "protocols" / "vectors" / "compressed_tensor"
CASES = {p.stem: json.loads(p.read_text()) for p in sorted(VECTORS.glob("*.json"))}
FRAMES = [n for n, c in CASES.items() if c["kind"] == "frame" and "error" not in c]
PACKETS = [n for n, c in CASES.items() if c["kind"] == "packets" and "error" not in c]
ERRORS = [n for n, c in CASES.items() if "error" in c]


def _quant(q: dict | None) -> QuantConfig | None:
    return None if q is None else QuantConfig(**q)


def _tensor(values: list[float], dtype: str, shape: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).to(DTYPE_NAMES[dtype]).reshape(shape)


def test_vector_set_covers_the_spec():
    assert len(FRAMES) >= 8 and PACKETS and len(ERRORS) >= 15
    bits = {CASES[n]["quant"]["bits"] for n in FRAMES if "quant" in CASES[n]}
    assert bits == {2, 3, 4, 8}
    codes = {CASES[n]["error"] for n in ERRORS}
    assert {
        "MALFORMED", "TRUNCATED", "UNSUPPORTED_VERSION", "UNKNOWN_CODEC", "UNSUPPORTED_BITS",
        "DTYPE_MISMATCH", "SHAPE_MISMATCH", "NON_FINITE", "UNKNOWN_EXAMPLE",
    } <= codes  # fmt: skip


@pytest.mark.parametrize("name", FRAMES)
def test_frame_vector_encodes_and_decodes(name: str):
    case = CASES[name]
    inp = case["input"]
    x = _tensor(inp["values"], inp["dtype"], inp["shape"])
    codec = make_codec(case["codec"], _quant(case.get("quant")))
    data, recon = codec.encode(x, ids=inp.get("ids", ()), seed=inp.get("seed", False), reconstruct=True)
    assert data.hex() == case["frame_hex"]
    got = codec.decode(bytes.fromhex(case["frame_hex"]))
    want = _tensor(case["decoded"], inp["dtype"], inp["shape"])
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert recon is not None and torch.equal(recon.to(want.dtype), want)  # the sender's view agrees


@pytest.mark.parametrize("name", PACKETS)
def test_packet_vector_keeps_both_sides_identical(name: str):
    case = CASES[name]
    d = case["delta"]
    cfg = DeltaConfig(
        quant=QuantConfig(**d["quant"]), seed_codec=d["seed_codec"], warmup_visits=d["warmup_visits"]
    )
    enc, dec = DeltaEncoder(cfg), DeltaDecoder(cfg)
    shape = case["example_shape"]
    for step in case["steps"]:
        ids = step["input"]["ids"]
        acts = _tensor(step["input"]["values"], "float32", [len(ids), *shape])
        packet = enc.encode(acts, ids)
        assert packet.hex() == step["packet_hex"]
        out, got_ids = dec.decode(bytes.fromhex(step["packet_hex"]))
        assert list(got_ids) == ids
        assert torch.equal(out, _tensor(step["decoded"], "float32", [len(ids), *shape]))
        for ex, values in step["buffers"].items():
            want = _tensor(values, "float32", shape)
            assert torch.equal(enc.store.get(int(ex)), want) and torch.equal(dec.store.get(int(ex)), want)


@pytest.mark.parametrize("name", ERRORS)
def test_bad_vector_is_rejected_with_its_code(name: str):
    case = CASES[name]
    if case["kind"] == "frame":
        with pytest.raises(CodecError) as info:
            make_codec("fp32").decode(bytes.fromhex(case["frame_hex"]))
    else:
        dec = DeltaDecoder(DeltaConfig())
        for seed in case.get("state", []):
            dec.decode(bytes.fromhex(seed))
        before = {i: dec.store.get(i).clone() for i in dec.store.ids()}
        with pytest.raises(CodecError) as info:
            dec.decode(bytes.fromhex(case["packet_hex"]))
        # a rejected packet changes no buffer
        assert set(dec.store.ids()) == set(before)
        assert all(torch.equal(dec.store.get(i), t) for i, t in before.items())
    assert info.value.code == ErrorCode[case["error"]]
