"""Swarm membership as soft state: announce this peer's signed record with a TTL, and read everyone's.

The ``Announcer`` stores this peer's ``PeerRecord`` under ``peers_key(swarm)`` with
the owner tag as subkey (so the RSA validator signs it and only this key may
overwrite it), re-publishing every ``interval`` with an increasing ``seq`` and an
expiration ``ttl`` seconds ahead. A peer that stops refreshing (crash, network
loss) vanishes when its entry expires; a graceful leave publishes OFFLINE first,
so the others notice at once. ``fetch_peers`` reads the key and keeps only
entries that pass ``check_peer_entry`` (signature binding, schema, freshness);
``merge_peer_entries`` keeps a daemon's list monotone across reads, and
``peers_view`` turns them into the JSON table that ``peerd status`` shows.
``KnownPeersStore`` remembers the peers seen, in the daemon's home, for its next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from hivemind.dht import DHT
from hivemind.utils import get_dht_time

from peerd.durable import remove_leftovers, replace_file
from peerd.errors import PeerdError, ProtocolError
from peerd.log import get_logger
from peerd.swarm.identity import check_peer_entry
from peerd.swarm.keys import peers_key
from peerd.swarm.node import dht_get_latest
from peerd.swarm.records import PeerRecord, PeerState, encode_peer_record
from peerd.tasks import within

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
            stored = await within(future, timeout or self.interval)
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
                await within(self._wake.wait(), wait)

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


def merge_peer_entries(
    known: dict[str, PeerEntry], fetched: Iterable[PeerEntry], *, now: float
) -> dict[str, PeerEntry]:
    """What a daemon lists after a read: per peer, the newest record it has seen that has not expired.

    One DHT read may find an older copy of a record than the last one did: the node that stored
    the newest refresh may be the crashed peer itself, and replicas are not updated atomically.
    Keeping the newest seen copy until its own expiration makes the list monotone: a crashed
    peer goes when its last refresh expires, not when a read happens to miss it.
    """
    merged = {pid: e for pid, e in known.items() if e.expires_at > now}
    for entry in fetched:
        current = merged.get(entry.record.peer_id)
        if current is None or (entry.record.updated_at, entry.record.seq) >= (
            current.record.updated_at,
            current.record.seq,
        ):
            merged[entry.record.peer_id] = entry
    return merged


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
                "host_id": prof.host_id if prof else None,
                "host_cores": prof.host_cores if prof else None,
                "threads": prof.threads if prof else None,
                "message_us": prof.message_us if prof else None,
                "wire_byte_ns": prof.wire_byte_ns if prof else None,
                "codec_us": prof.codec_us if prof else None,
                "codec_value_ns": prof.codec_value_ns if prof else None,
                "idle_cores": prof.idle_cores if prof else None,
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


# -- the peers remembered between runs -------------------------------------------------------------
#
# A daemon writes the peers it has seen to HOME/known_peers.json and, on its next start,
# bootstraps from them as well as from --initial-peers: a swarm then outlives its first
# peer, and a restarted volunteer needs no address. The file is local state, not a wire
# message: JSON for a human to read, bounded, replaced atomically, and ignored with a
# warning (never a crash) when it is corrupt, too large, or not ours.

KNOWN_PEERS_FILE = "known_peers.json"
KNOWN_PEERS_KIND = "peerd-known-peers"
KNOWN_PEERS_VERSION = 1
MAX_KNOWN_PEERS = 32  # enough to find a live peer after heavy churn; p2pd dials them one by one
MAX_MADDRS_PER_PEER = 8
MAX_KNOWN_PEERS_BYTES = 64 * 1024  # 32 peers x 8 addresses of ~100 characters fit well below this
KNOWN_PEER_MAX_AGE_S = 7 * 24 * 3600.0  # a peer unseen for a week is not worth dialling at start
RESAVE_S = 300.0  # rewrite an unchanged list this often, so that "seen at" stays roughly current


class KnownPeer(msgspec.Struct, frozen=True):
    """A peer seen in this swarm: its dialable addresses (each ending in /p2p/<peer id>) and when (Unix time)."""

    peer_id: str
    maddrs: tuple[str, ...]
    seen_at: float


class KnownPeersFile(msgspec.Struct, frozen=True):
    """The file's layout; ``kind`` and ``version`` tell our file from anything else at that path."""

    kind: str
    version: int
    swarm: str
    peers: tuple[KnownPeer, ...] = ()


def _dialable(peer_id: str, maddrs: Iterable[str]) -> tuple[str, ...]:
    """``maddrs`` that end in this peer's /p2p/ id (appended where missing), deduplicated, at most 8."""
    out: list[str] = []
    for maddr in maddrs:
        if not maddr.startswith("/") or any(c.isspace() for c in maddr):
            continue
        _, sep, tail = maddr.rpartition("/p2p/")
        full = maddr if sep and tail == peer_id else (f"{maddr}/p2p/{peer_id}" if not sep else "")
        if full and full not in out:
            out.append(full)
    return tuple(out[:MAX_MADDRS_PER_PEER])


def remember_peers(
    known: Iterable[KnownPeer], seen: Iterable[PeerRecord], *, self_id: str, now: float
) -> tuple[KnownPeer, ...]:
    """The known list after seeing ``seen`` at ``now``: newest first, without this peer, bounded, fresh."""
    merged: dict[str, KnownPeer] = {}
    for peer in known:
        if now - peer.seen_at <= KNOWN_PEER_MAX_AGE_S:
            merged[peer.peer_id] = peer
    for record in seen:
        maddrs = _dialable(record.peer_id, record.maddrs)
        if maddrs:
            merged[record.peer_id] = KnownPeer(record.peer_id, maddrs, now)
    merged.pop(self_id, None)
    ordered = sorted(merged.values(), key=lambda p: (-p.seen_at, p.peer_id))
    return tuple(ordered[:MAX_KNOWN_PEERS])


def bootstrap_peers(configured: Iterable[str], known: Iterable[KnownPeer]) -> list[str]:
    """Where to bootstrap: the configured initial peers first, then the remembered ones, each address once."""
    out = list(dict.fromkeys(configured))
    for peer in known:
        out += [m for m in peer.maddrs if m not in out]
    return out


class KnownPeersStore:
    """``HOME/known_peers.json`` of one swarm: ``load()`` at start, ``update()`` as peers are seen."""

    def __init__(self, path: Path, swarm: str) -> None:
        self.path = path
        self.swarm = swarm
        self.peers: tuple[KnownPeer, ...] = ()
        self._saved: tuple[tuple[str, tuple[str, ...]], ...] | None = None  # what the file holds, less times
        self._saved_at = -math.inf

    def load(self) -> tuple[KnownPeer, ...]:
        """The remembered peers; an absent file is none, a bad or foreign one is none with a warning.

        Also deletes the temporaries of a save that was killed (this daemon is the file's only writer).
        """
        if removed := remove_leftovers(self.path):
            logger.info("removed %d temporary file(s) of an interrupted save of %s", removed, self.path)
        self.peers = self._read()
        self._saved = _content(self.peers)
        return self.peers

    def _read(self) -> tuple[KnownPeer, ...]:
        try:
            with open(self.path, "rb") as fh:
                raw = fh.read(MAX_KNOWN_PEERS_BYTES + 1)
        except FileNotFoundError:
            return ()
        except OSError as exc:
            logger.warning("cannot read the remembered peers in %s (%s); ignoring them", self.path, exc)
            return ()
        if len(raw) > MAX_KNOWN_PEERS_BYTES:
            logger.warning(
                "%s is larger than %d bytes, so not a file peerd wrote; ignoring it",
                self.path,
                MAX_KNOWN_PEERS_BYTES,
            )
            return ()
        try:
            doc = msgspec.json.decode(raw, type=KnownPeersFile)
        except msgspec.DecodeError as exc:  # ValidationError is a subclass: wrong types name their field
            logger.warning("%s is not a readable peers list (%s); ignoring it", self.path, exc)
            return ()
        if doc.kind != KNOWN_PEERS_KIND:
            logger.warning("%s is a %r file, not peerd's remembered peers; ignoring it", self.path, doc.kind)
            return ()
        if doc.version != KNOWN_PEERS_VERSION:
            logger.warning(
                "%s has format version %d (this peerd reads %d); ignoring it",
                self.path,
                doc.version,
                KNOWN_PEERS_VERSION,
            )
            return ()
        if doc.swarm != self.swarm:
            logger.warning(
                "%s remembers peers of swarm %r, not %r; ignoring them", self.path, doc.swarm, self.swarm
            )
            return ()
        peers = [KnownPeer(p.peer_id, _dialable(p.peer_id, p.maddrs), p.seen_at) for p in doc.peers]
        return tuple(p for p in peers if p.maddrs and math.isfinite(p.seen_at))[:MAX_KNOWN_PEERS]

    def update(self, seen: Iterable[PeerRecord], *, self_id: str, now: float) -> bool:
        """Merge ``seen``; True when the file should be rewritten (new peers or addresses, or it is old)."""
        self.peers = remember_peers(self.peers, seen, self_id=self_id, now=now)
        return _content(self.peers) != self._saved or now - self._saved_at >= RESAVE_S

    def save(self, now: float) -> None:
        """Replace the file atomically (temporary file, fsync, rename): a crash leaves the old or the new list."""
        peers = self.peers
        doc = KnownPeersFile(KNOWN_PEERS_KIND, KNOWN_PEERS_VERSION, self.swarm, peers)
        data = msgspec.json.format(msgspec.json.encode(doc), indent=1)
        try:
            replace_file(self.path, lambda fh: fh.write(data))
        except OSError as exc:
            logger.warning("cannot save the remembered peers to %s: %s", self.path, exc)
            return
        self._saved, self._saved_at = _content(peers), now
        logger.debug("remembered %d peers in %s", len(peers), self.path)


def _content(peers: Iterable[KnownPeer]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple(sorted((p.peer_id, p.maddrs) for p in peers))
