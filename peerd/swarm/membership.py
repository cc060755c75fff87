"""Swarm membership as soft state: announce this peer's signed record with a TTL, and read everyone's.

The ``Announcer`` stores this peer's ``PeerRecord`` under ``peers_key(swarm)`` with
the owner tag as subkey (so the RSA validator signs it and only this key may
overwrite it), re-publishing every ``interval`` with an increasing ``seq`` and an
expiration ``ttl`` seconds ahead. A peer that stops refreshing (crash, network
loss) vanishes when its entry expires; a graceful leave publishes OFFLINE first,
so the others notice at once. ``fetch_peers`` reads the key and keeps only
entries that pass ``check_peer_entry`` (signature binding, schema, freshness);
``peers_view`` turns them into the JSON table that ``peerd status`` shows.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hivemind.dht import DHT
from hivemind.utils import get_dht_time

from peerd.errors import PeerdError, ProtocolError
from peerd.log import get_logger
from peerd.swarm.identity import check_peer_entry
from peerd.swarm.keys import peers_key
from peerd.swarm.node import dht_get_latest
from peerd.swarm.records import PeerRecord, PeerState, encode_peer_record

logger = get_logger(__name__)

BuildRecord = Callable[[PeerState, int, float], PeerRecord]  # (state, seq, now) -> record
RETRY_MIN_S = 1.0  # first retry after a failed store; doubles up to the refresh interval


class Announcer:
    """Keeps this peer's record alive in the DHT; ``run()`` until cancelled, then ``leave()``."""

    def __init__(
        self,
        dht: DHT,
        *,
        swarm: str,
        owner_tag: bytes,
        build: BuildRecord,
        ttl: float,
        interval: float,
        clock: Callable[[], float] = get_dht_time,
    ) -> None:
        if not 0 < interval < ttl:
            raise ValueError(f"announce interval {interval} must be in (0, ttl={ttl})")
        self.dht = dht
        self.key = peers_key(swarm)
        self.owner_tag = owner_tag
        self.build = build
        self.ttl = ttl
        self.interval = interval
        self.clock = clock
        self.state = PeerState.JOINING
        self.seq = 0
        self.last_record: PeerRecord | None = None
        self.last_published_at: float | None = None
        self._wake = asyncio.Event()

    def set_state(self, state: PeerState) -> None:
        """Change the advertised state; the running loop publishes it right away."""
        self.state = state
        self._wake.set()

    def poke(self) -> None:
        """Publish soon (e.g. fresh link measurements) instead of waiting for the next refresh."""
        self._wake.set()

    async def publish(self, timeout: float | None = None) -> bool:
        """Store one record with the next ``seq``; False (logged) if no DHT node accepted it."""
        self.seq += 1
        now = self.clock()
        record = self.build(self.state, self.seq, now)
        raw = encode_peer_record(record)  # ProtocolError here is a daemon bug: let it surface
        future = self.dht.store(
            self.key, raw, expiration_time=now + self.ttl, subkey=self.owner_tag, return_future=True
        )
        try:
            stored = await asyncio.wait_for(future, timeout=timeout or self.interval)
        except TimeoutError:
            future.cancel()
            logger.warning("publishing peer record seq %d timed out", self.seq)
            return False
        if not stored:
            logger.warning("no DHT node accepted peer record seq %d (state %s)", self.seq, self.state.value)
            return False
        self.last_record = record
        self.last_published_at = now
        logger.debug(
            "published peer record seq %d (%s, %d links)", self.seq, self.state.value, len(record.links)
        )
        return True

    async def run(self) -> None:
        """Publish now and then every ``interval`` (sooner after ``poke``/``set_state``); retry failures with backoff."""
        retry = RETRY_MIN_S
        while True:
            self._wake.clear()
            try:
                ok = await self.publish()
            except asyncio.CancelledError:
                raise
            except PeerdError:
                raise
            except Exception:  # DHT hiccups (pipe, RPC) must not end the heartbeat
                logger.warning("publishing the peer record failed", exc_info=True)
                ok = False
            wait = self.interval if ok else min(retry, self.interval)
            retry = RETRY_MIN_S if ok else min(retry * 2, self.interval)
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=wait)

    async def leave(self, timeout: float = 5.0) -> bool:
        """Announce OFFLINE once (the entry then expires on its own); False if it could not be stored in time."""
        self.state = PeerState.OFFLINE
        try:
            return await self.publish(timeout=timeout)
        except Exception:
            logger.warning("announcing OFFLINE failed", exc_info=True)
            return False


@dataclass
class PeerEntry:
    """A validated peer record together with the DHT expiration of its entry."""

    record: PeerRecord
    expires_at: float


async def fetch_peers(
    dht: DHT, swarm: str, *, timeout: float = 10.0, now: float | None = None
) -> list[PeerEntry]:
    """Read every live peer record of ``swarm``: validated, expired ones dropped, one entry per peer id.

    Malformed or forged entries are logged and skipped; they never raise. Raises only
    ``PeerdError(TIMEOUT)`` if the DHT does not answer within ``timeout``.
    """
    found = await dht_get_latest(dht, peers_key(swarm), timeout=timeout, what="the peer list")
    if found is None:
        return []
    return parse_peer_entries(found.value, now=get_dht_time() if now is None else now)


def parse_peer_entries(value: Any, *, now: float) -> list[PeerEntry]:
    """The pure part of ``fetch_peers``: ``value`` is what the DHT returned for the peers key."""
    items = _dictionary_items(value)
    if items is None:
        logger.warning("peers key holds a %s, not a subkey dictionary; ignoring it", type(value).__name__)
        return []
    best: dict[str, PeerEntry] = {}
    for subkey, entry in items:
        raw, expiration = getattr(entry, "value", None), getattr(entry, "expiration_time", None)
        if not isinstance(expiration, int | float):
            logger.info("skipping a peer entry without expiration")
            continue
        if expiration <= now:
            continue  # expired: normal soft-state disappearance, not an error
        try:
            record = check_peer_entry(subkey, raw, expiration, now)
        except ProtocolError as exc:
            logger.info("skipping peer entry: %s", exc)
            continue
        current = best.get(record.peer_id)
        if current is None or (record.updated_at, record.seq) > (
            current.record.updated_at,
            current.record.seq,
        ):
            best[record.peer_id] = PeerEntry(record, float(expiration))
    return sorted(best.values(), key=lambda e: (e.record.name, e.record.peer_id))


def _dictionary_items(value: Any) -> Iterable[tuple[Any, Any]] | None:
    if isinstance(value, dict):
        return list(value.items())
    items = getattr(value, "items", None)  # hivemind's DictionaryDHTValue
    if callable(items):
        return list(items())
    return None


# -- the status table ------------------------------------------------------------------------------


def short_id(peer_id: str) -> str:
    """Last 8 characters: the first ones are the same multihash prefix (Qm…, 12D3KooW…) for everyone."""
    return peer_id[-8:]


def peers_view(entries: Iterable[PeerEntry], *, now: float, self_id: str | None = None) -> dict[str, Any]:
    """JSON-able membership table: ``peers`` (one row per peer) and ``links`` (every measurement)."""
    peers, links = [], []
    for entry in entries:
        rec = entry.record
        prof = rec.profile
        peers.append(
            {
                "peer_id": rec.peer_id,
                "short_id": short_id(rec.peer_id),
                "name": rec.name,
                "state": rec.state.value,
                "self": rec.peer_id == self_id,
                "device": prof.name if prof else None,
                "device_kind": prof.kind.value if prof else None,
                "tflops": dict(prof.tflops) if prof else {},
                "memory_total_bytes": prof.memory_total_bytes if prof else None,
                "memory_free_bytes": prof.memory_free_bytes if prof else None,
                "maddrs": list(rec.maddrs),
                "software_version": rec.software_version,
                "seq": rec.seq,
                "started_at": rec.started_at,
                "updated_at": rec.updated_at,
                "last_seen_s": round(max(0.0, now - rec.updated_at), 3),
                "expires_in_s": round(entry.expires_at - now, 3),
            }
        )
        for link in rec.links:
            links.append(
                {
                    "src": rec.peer_id,
                    "dst": link.peer_id,
                    "status": link.status.value,
                    "rtt_ms": link.rtt_ms,
                    "bw_up_mbps": link.bw_up_mbps,
                    "bw_down_mbps": link.bw_down_mbps,
                    "measured_at": link.measured_at,
                    "age_s": round(max(0.0, now - link.measured_at), 3),
                }
            )
    return {"now": now, "peers": peers, "links": links}
