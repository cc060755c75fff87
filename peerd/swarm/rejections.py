"""What this daemon refused or rejected from other peers, by layer and error code: the counters of ``peerd status`` and ``/metrics``.

Layers (``peerd status --json``: ``refusals.<layer>.<CODE>``; /metrics: ``peerd_refusals_total{layer, code}``):

- ``streams``      — streams refused before their handler ran (BANNED, NOT_ALLOWED, RATE_LIMITED, BUSY);
- ``handlers``     — streams a handler ended on the peer's fault: a refused hello (NOT_ALLOWED,
  STALE, FROM_FUTURE), a spent byte budget (RATE_LIMITED), malformed or oversized frames;
- ``dht_records``  — DHT records the record validators rejected on store or on read: no or a
  wrong swarm MAC (NOT_ALLOWED), a forged signature (BAD_SIGNATURE), a peer record that is
  malformed, stale, from the future or bound to another key;
- ``job_records``  — job records and indexes the job catalog skipped (MALFORMED, NOT_OWNER, ...).

The validators run in the DHT's own process, so their counts live there (``DHT_REJECTED``)
and ``dht_rejections`` is the coroutine ``DHT.run_coroutine`` runs to read them.
Counters only grow; ``bans`` is the number of bans this daemon has issued.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from peerd.errors import ErrorCode

# Per process; only the DHT process's copy is ever counted (validators run there).
DHT_REJECTED: Counter[str] = Counter()

LAYERS = ("streams", "handlers", "dht_records", "job_records")


def count_dht(code: ErrorCode) -> None:
    """One DHT record a validator rejected (called in the DHT process)."""
    DHT_REJECTED[code.name] += 1


async def dht_rejections(_dht: Any, _node: Any) -> dict[str, int]:
    """``DHT.run_coroutine`` target: the DHT process's rejection counts by code (module-level: it is pickled)."""
    return dict(DHT_REJECTED)


def by_name(counts: Mapping[Any, int]) -> dict[str, int]:
    """``{code name: n}`` of counters keyed by ``ErrorCode`` or its name, zeros left out, sorted."""
    out: Counter[str] = Counter()
    for code, n in counts.items():
        if n:
            out[code.name if isinstance(code, ErrorCode) else str(code)] += n
    return dict(sorted(out.items()))


@dataclass
class Refusals:
    """One snapshot of every layer's counts (what ``view()`` puts under ``refusals``)."""

    streams: dict[str, int] = field(default_factory=dict)
    handlers: dict[str, int] = field(default_factory=dict)
    dht_records: dict[str, int] = field(default_factory=dict)
    job_records: dict[str, int] = field(default_factory=dict)
    bans: int = 0

    def total(self) -> int:
        return sum(sum(getattr(self, layer).values()) for layer in LAYERS)

    def view(self) -> dict[str, Any]:
        out: dict[str, Any] = {layer: by_name(getattr(self, layer)) for layer in LAYERS}
        out["bans"] = self.bans
        out["total"] = self.total()
        return out
