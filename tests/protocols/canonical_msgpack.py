"""An independent canonical msgpack writer for the vector tests (protocols/README.md, "Conventions").

Written from the spec, byte by byte, so that a bug in peerd's encoder cannot hide behind the
same bug in the expected bytes: it imports nothing from peerd and no msgpack library.
Input is a vector's JSON form: ``None``, bools, ints, finite floats, str, lists, str-keyed
maps, and ``{"bin": "<hex>"}`` for a bin value. Output: maps with keys sorted by UTF-8
bytes at every level, integers in their smallest form, floats always float64, text as
str, bytes as bin. Test modules load it by path: pytest runs them with
``--import-mode=importlib`` and the test directories are not packages.
"""

from __future__ import annotations

import math
import struct
from typing import Any

# (bound, type byte, struct format), narrowest first: an int takes the first form it fits
_UNSIGNED = [(0xFF, 0xCC, ">B"), (0xFFFF, 0xCD, ">H"), (0xFFFFFFFF, 0xCE, ">I"), (2**64 - 1, 0xCF, ">Q")]
_SIGNED = [(2**7, 0xD0, ">b"), (2**15, 0xD1, ">h"), (2**31, 0xD2, ">i"), (2**63, 0xD3, ">q")]


def _int(n: int) -> bytes:
    if 0 <= n < 0x80:
        return bytes([n])  # positive fixint
    if -32 <= n < 0:
        return struct.pack(">b", n)  # negative fixint: 111xxxxx
    if n > 0:
        for top, code, fmt in _UNSIGNED:
            if n <= top:
                return bytes([code]) + struct.pack(fmt, n)
    else:
        for bound, code, fmt in _SIGNED:
            if n >= -bound:
                return bytes([code]) + struct.pack(fmt, n)
    raise ValueError(f"{n} does not fit in 64 bits")


def _sized(n: int, fix: tuple[int, int] | None, codes: tuple[int, ...], widths: tuple[str, ...]) -> bytes:
    """A length prefix: the fix form when ``n`` fits it, else the first wide form that does."""
    if fix is not None and n < fix[1]:
        return bytes([fix[0] | n])
    for code, fmt in zip(codes, widths, strict=True):
        if n < 256 ** struct.calcsize(fmt):
            return bytes([code]) + struct.pack(fmt, n)
    raise ValueError(f"length {n} is too large")


def canonical(obj: Any) -> bytes:
    """The canonical msgpack bytes of a vector's JSON form (see the module docstring)."""
    if obj is None:
        return b"\xc0"
    if obj is True:
        return b"\xc3"
    if obj is False:
        return b"\xc2"
    if isinstance(obj, int):
        return _int(obj)
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError("canonical messages carry finite floats only")
        return b"\xcb" + struct.pack(">d", obj)  # always float64, even where float32 would be exact
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _sized(len(raw), (0xA0, 32), (0xD9, 0xDA, 0xDB), (">B", ">H", ">I")) + raw
    if isinstance(obj, dict) and set(obj) == {"bin"}:
        raw = bytes.fromhex(obj["bin"])
        return _sized(len(raw), None, (0xC4, 0xC5, 0xC6), (">B", ">H", ">I")) + raw
    if isinstance(obj, list):
        return _sized(len(obj), (0x90, 16), (0xDC, 0xDD), (">H", ">I")) + b"".join(canonical(x) for x in obj)
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("canonical maps have str keys")
        keys = sorted(obj, key=lambda k: k.encode("utf-8"))
        head = _sized(len(obj), (0x80, 16), (0xDE, 0xDF), (">H", ">I"))
        return head + b"".join(canonical(k) + canonical(obj[k]) for k in keys)
    raise TypeError(f"no canonical form for {type(obj).__name__}")
