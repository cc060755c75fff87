"""Wire primitives for consensus messages: canonical msgpack, typed field readers, hashes.

Canonical form (``protocols/consensus.md``): maps with keys in sorted order, floats as
float64, hashes as 32-byte ``bin``, strings as UTF-8 ``str``. Readers raise
``ProtocolError(MALFORMED)`` naming the offending field.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgpack

from peerd.errors import ConfigError, ErrorCode, ProtocolError
from peerd.sched.allocation import Allocation


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def sorted_map(items: dict[str, Any]) -> dict[str, Any]:
    """Keys in byte order (all keys are ASCII), so equal maps pack to equal bytes."""
    return {k: items[k] for k in sorted(items)}


def malformed(field: str, what: str) -> ProtocolError:
    return ProtocolError(f"consensus message field {field!r}: {what}", code=ErrorCode.MALFORMED)


class Fields:
    """Typed access to one decoded msgpack map; ``where`` prefixes field names in errors.

    Readers are not named after builtins (``str``, ``int``, ...): in a class body such a
    method would shadow the builtin for every later annotation.
    """

    def __init__(self, m: Any, where: str) -> None:
        if not isinstance(m, dict):
            raise malformed(where, f"must be a map, got {type(m).__name__}")
        self.m, self.where = m, where

    def name(self, field: str) -> str:
        return f"{self.where}.{field}" if self.where else field

    def get(self, field: str) -> Any:
        if field not in self.m:
            raise malformed(self.name(field), "missing")
        return self.m[field]

    def text(self, field: str) -> str:
        v = self.get(field)
        if not isinstance(v, str) or not v:
            raise malformed(self.name(field), f"must be a non-empty string, got {v!r}")
        return v

    def uint(self, field: str, hi: int | None = None) -> int:
        v = self.get(field)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (hi is not None and v > hi):
            raise malformed(
                self.name(field), f"must be an integer in [0, {hi if hi is not None else 'inf'}], got {v!r}"
            )
        return v

    def number(self, field: str, *, positive: bool = False) -> float:
        v = self.get(field)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise malformed(self.name(field), f"must be a finite number >= 0, got {v!r}")
        if positive and v == 0:
            raise malformed(self.name(field), "must be > 0")
        return float(v)

    def hash(self, field: str) -> bytes:
        v = self.get(field)
        if not isinstance(v, bytes) or len(v) != 32:
            raise malformed(self.name(field), "must be a 32-byte hash")
        return v

    def array(self, field: str) -> list[Any]:
        v = self.get(field)
        if not isinstance(v, list):
            raise malformed(self.name(field), f"must be an array, got {type(v).__name__}")
        return v

    def peers(self, field: str, *, sorted_unique: bool = False) -> tuple[str, ...]:
        v = self.array(field)
        if not all(isinstance(p, str) and p for p in v):
            raise malformed(self.name(field), "must be an array of non-empty peer ids")
        if sorted_unique and v != sorted(set(v)):
            raise malformed(self.name(field), "peer ids must be sorted and unique")
        return tuple(v)


# --- allocations and digests -----------------------------------------------------------------


def allocation_to_wire(allocation: Allocation) -> dict[str, Any]:
    """Canonical wire form: replicas ordered by stage-0 device, spares sorted, ``layers`` nil if even."""
    c = allocation.canonical()
    return {
        "layers": list(c.layers) if c.layers is not None else None,
        "spares": list(c.spares),
        "stages": [list(stage) for stage in c.stages],
    }


def allocation_from_wire(m: Any, where: str) -> Allocation:
    f = Fields(m, where)
    layers = f.m.get("layers")
    if layers is not None and not (isinstance(layers, list) and all(type(x) is int for x in layers)):
        raise malformed(f.name("layers"), "must be nil or an array of integers")
    spares = f.peers("spares") if "spares" in f.m else ()
    try:
        return Allocation.from_plain(f.array("stages"), spares, layers).canonical()
    except ConfigError as exc:
        text = Exception.__str__(exc).removeprefix(f"{exc.field}: ")
        raise malformed(f.name(exc.field), text) from None


def allocation_hash(allocation: Allocation) -> bytes:
    """The scheduler's canonical allocation digest (``Allocation.digest``), as 32 bytes."""
    return bytes.fromhex(allocation.digest())


def candidate_id(roster_digest: bytes, allocation: Allocation) -> bytes:
    """Identity voted on: the same allocation scored on another roster is another candidate."""
    return sha(pack([roster_digest, allocation_hash(allocation)]))


def roster_digest(refs: tuple[tuple[str, bytes], ...] | list[tuple[str, bytes]]) -> bytes:
    """Digest of a roster given ``(peer, entry_hash)`` pairs (order-independent)."""
    return sha(pack([[peer, h] for peer, h in sorted(refs)]))
