"""Planar bit packing: round trips at every width and awkward size, and agreement with the spec's reference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from peerd.compress.packing import code_buffer, pack, pack_layout, unpack
from peerd.errors import CodecError, ErrorCode

_REF = Path(__file__).resolve().parents[3] / "protocols" / "vectors" / "compressed_tensor" / "reference.py"
_spec = importlib.util.spec_from_file_location("ct_reference", _REF)
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)  # type: ignore[union-attr]

SIZES = [0, 1, 2, 5, 7, 8, 9, 31, 63, 64, 65, 127, 128, 1000, 4096, 4099]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", SIZES)
def test_pack_matches_reference_and_round_trips(bits: int, n: int):
    gen = torch.Generator().manual_seed(n * 10 + bits)
    lay = pack_layout(bits, n)
    codes = code_buffer(lay)
    codes[:n] = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=gen)
    packed = pack(codes, lay)
    assert packed.numel() == lay.nbytes == len(reference.pack(codes[:n].tolist(), bits))
    assert bytes(packed.numpy().tobytes()) == reference.pack(codes[:n].tolist(), bits)
    assert torch.equal(unpack(packed.clone(), lay)[:n], codes[:n])
    assert reference.unpack(bytes(packed.numpy().tobytes()), bits, n) == codes[:n].tolist()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_packed_size_is_bits_per_code(bits: int):
    lay = pack_layout(bits, 1024 * 4096)
    assert lay.nbytes * 8 == bits * 1024 * 4096  # no padding at real sizes


def test_spec_example_bytes():
    lay = pack_layout(4, 5)
    codes = code_buffer(lay)
    codes[:5] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    assert bytes(pack(codes, lay).numpy().tobytes()) == bytes.fromhex("415203")


def test_unpack_from_misaligned_buffer():
    """Payloads are views into received bytes at any offset; unpacking must not depend on alignment."""
    lay = pack_layout(3, 256)
    codes = code_buffer(lay)
    codes.random_(0, 8)
    blob = b"\x00" * 3 + bytes(pack(codes, lay).numpy().tobytes())
    view = torch.frombuffer(bytearray(blob), dtype=torch.uint8)[3:]
    assert torch.equal(unpack(view, lay), codes)


@pytest.mark.parametrize("bits", [0, 1, 5, 6, 7, 16])
def test_unsupported_bits(bits: int):
    with pytest.raises(CodecError) as info:
        pack_layout(bits, 10)
    assert info.value.code == ErrorCode.UNSUPPORTED_BITS
