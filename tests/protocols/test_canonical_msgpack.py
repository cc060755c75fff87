"""The vector tests' independent canonical writer agrees with msgpack-python on every form it writes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import msgpack
import pytest

_spec = importlib.util.spec_from_file_location(
    "canonical_msgpack", Path(__file__).with_name("canonical_msgpack.py")
)
canonical_msgpack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(canonical_msgpack)  # type: ignore[union-attr]
canonical = canonical_msgpack.canonical

INTS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
INTS += [-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)]
LENGTHS = [0, 1, 15, 16, 31, 32, 255, 256, 65535, 65536]


@pytest.mark.parametrize("value", [None, True, False, 0.0, -0.0, 1.5, 1e300, 1767225600.0, *INTS])
def test_scalars(value):
    assert canonical(value) == msgpack.packb(value, use_bin_type=True)


@pytest.mark.parametrize("n", LENGTHS)
def test_sized_forms(n):
    text, data = "é" * (n // 2) + "x" * (n % 2), bytes(range(256)) * (n // 256) + bytes(n % 256)
    assert canonical(text) == msgpack.packb(text, use_bin_type=True)
    assert canonical({"bin": data.hex()}) == msgpack.packb(data, use_bin_type=True)
    assert canonical(list(range(n))) == msgpack.packb(list(range(n)))
    keyed = {f"k{i:05d}": i for i in range(n)}
    assert canonical(keyed) == msgpack.packb(dict(sorted(keyed.items())))


def test_maps_are_sorted_by_utf8_bytes_at_every_level():
    nested = {"b": {"z": 1, "a": [{"y": 2, "x": 3}]}, "a": None, "é": 1, "~": 2}
    expected = {"a": None, "b": {"a": [{"x": 3, "y": 2}], "z": 1}, "~": 2, "é": 1}
    assert canonical(nested) == msgpack.packb(expected, use_bin_type=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 2**64, -(2**63) - 1, {1: 2}, b"raw"])
def test_what_has_no_canonical_form_is_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        canonical(bad)
