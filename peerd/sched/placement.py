"""Seeded random placement: the "Megatron-like default" a scheduler is compared against.

Megatron-LM (and most launchers) give pipeline/replica ranks to devices in the order the
devices come, with no regard for the links between them; on a heterogeneous network that
order is effectively random. ``random_allocation`` reproduces that baseline: the roster's
devices, sorted by id, are shuffled by a seed and rank ``r`` runs tasklet
``(stage r // d_dp, replica r % d_dp)``; devices past ``d_pp x d_dp`` sit out as spares.
Layers are split evenly (``layers=None``), as a launcher without a cost model would.

The shuffle must give the same allocation on every peer (consensus votes on it), so it
draws from SHA-256 of public data (``placement_seed``: the job id and the spec's seed, not
the epoch, so a re-plan on an unchanged roster keeps the allocation) and not from numpy or
``random``, whose streams may change between versions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from peerd.errors import ConfigError
from peerd.sched.allocation import Allocation
from peerd.sched.problem import Shape


def placement_seed(*parts: str | int) -> bytes:
    """A 32-byte seed from public values (e.g. job id, ``planning.placement_seed``, epoch)."""
    text = "\x1f".join(f"{type(p).__name__}:{p}" for p in parts)
    return hashlib.sha256(text.encode("utf-8")).digest()


def _draw(seed: bytes, counter: int, below: int) -> int:
    """A uniform integer in ``[0, below)``: the counter's hash, rejecting the biased tail."""
    limit = (1 << 64) - (1 << 64) % below
    while True:
        value = int.from_bytes(hashlib.sha256(seed + counter.to_bytes(8, "big")).digest()[:8], "big")
        if value < limit:
            return value % below
        counter += 1 << 32  # a fresh, still deterministic draw (each position uses its own counter range)


def seeded_shuffle(items: Sequence[str], seed: bytes) -> list[str]:
    """Fisher-Yates shuffle of ``items`` (sorted first, so the input order does not matter)."""
    out = sorted(items)
    for i in range(len(out) - 1, 0, -1):
        j = _draw(seed, i, i + 1)
        out[i], out[j] = out[j], out[i]
    return out


def random_allocation(device_ids: Sequence[str], shape: Shape, seed: bytes) -> Allocation:
    """Ranks in seeded random order: rank ``r`` -> stage ``r // d_dp``, replica ``r % d_dp``; the rest spares."""
    if len(set(device_ids)) != len(device_ids):
        raise ConfigError("devices", "device ids must be unique")
    if shape.d_pp < 1 or shape.d_dp < 1:
        raise ConfigError("shape", f"d_pp and d_dp must be >= 1, got {shape}")
    if shape.active > len(device_ids):
        raise ConfigError("shape", f"{shape} needs {shape.active} devices, the roster has {len(device_ids)}")
    ranks = seeded_shuffle(device_ids, seed)
    stages = tuple(tuple(ranks[i * shape.d_dp : (i + 1) * shape.d_dp]) for i in range(shape.d_pp))
    return Allocation(stages, tuple(sorted(ranks[shape.active :])), None)
