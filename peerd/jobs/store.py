"""Signed per-author DHT entries as the jobs layer sees them: ``put`` my value, ``read`` everyone's.

Every job-related key holds one entry per author, stored under the author's owner subkey, so
hivemind's RSA validator guarantees who wrote it. ``DhtStore`` wraps a running hivemind DHT
(passed in by the daemon; this layer never imports hivemind) and turns subkeys into the
authors' peer ids; ``MemoryStore`` is the same interface over an in-process dictionary with
optional lost reads, for offline driver tests and benchmarks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from peerd.errors import ErrorCode, PeerdError, ProtocolError
from peerd.log import get_logger
from peerd.swarm.identity import peer_id_from_owner_tag
from peerd.swarm.node import dht_get_latest, dht_get_many_latest
from peerd.tasks import within

logger = get_logger(__name__)


@dataclass(frozen=True)
class Entry:
    """One author's value under a key."""

    author: str  # peer id of the key that signed it (derived from the subkey)
    value: bytes
    expires_at: float


class RecordStore(Protocol):
    """Where the planner, the job catalog and the runner read and write their records."""

    me: str

    def now(self) -> float: ...

    async def put(self, key: str, value: bytes, expires_at: float) -> bool: ...

    async def read(self, key: str) -> list[Entry]: ...

    async def read_many(self, keys: Sequence[str]) -> dict[str, list[Entry]]:
        """``read`` of each key, in one lookup where the store can; PeerdError(TIMEOUT) fails them all."""
        ...


class DhtStore:
    """``RecordStore`` over a hivemind DHT: values are stored under ``owner_tag`` (signed by the DHT's validator)."""

    def __init__(
        self, dht: Any, owner_tag: bytes, me: str, clock: Callable[[], float], *, timeout: float = 10.0
    ) -> None:
        self.dht, self.owner_tag, self.me, self.clock, self.timeout = dht, owner_tag, me, clock, timeout

    def now(self) -> float:
        return self.clock()

    async def put(self, key: str, value: bytes, expires_at: float) -> bool:
        future = self.dht.store(
            key, value, expiration_time=expires_at, subkey=self.owner_tag, return_future=True
        )
        try:
            return bool(await within(future, self.timeout))
        except TimeoutError:
            future.cancel()
            logger.info("storing %s timed out", key)
            return False

    async def read(self, key: str) -> list[Entry]:
        """Every live entry under ``key`` whose subkey is an owner tag; PeerdError(TIMEOUT) if the DHT is silent."""
        return self._entries(key, await dht_get_latest(self.dht, key, timeout=self.timeout, what=key))

    async def read_many(self, keys: Sequence[str]) -> dict[str, list[Entry]]:
        """``read`` of every key by one traversal of the DHT."""
        what = keys[0] if len(keys) == 1 else f"{len(keys)} keys"
        found = await dht_get_many_latest(self.dht, keys, timeout=self.timeout, what=what)
        return {key: self._entries(key, value) for key, value in found.items()}

    def _entries(self, key: str, found: Any) -> list[Entry]:
        if found is None:
            return []
        items = getattr(found.value, "items", None)
        if not callable(items):
            return []  # a plain value under a job key: not ours (every peerd writer uses a subkey)
        now = self.clock()
        out = []
        for subkey, item in items():
            value, expires = getattr(item, "value", None), getattr(item, "expiration_time", None)
            if not isinstance(value, bytes) or not isinstance(expires, int | float) or expires <= now:
                continue
            try:
                author = peer_id_from_owner_tag(subkey) if isinstance(subkey, bytes) else None
            except ProtocolError:
                author = None
            if author is None:
                logger.debug("skipping an entry of %s without an owner subkey", key)
                continue
            out.append(Entry(author, value, float(expires)))
        return out


class MemoryDHT:
    """An in-process stand-in for the DHT: ``key -> author -> (value, expiration)``, newer expiration wins."""

    def __init__(self, clock: Callable[[], float], *, miss: float = 0.0, seed: int = 0) -> None:
        self.clock = clock
        self.miss = miss  # probability that one read does not see one entry (a DHT lookup that missed it)
        self.rng = random.Random(seed)
        self.data: dict[str, dict[str, tuple[bytes, float]]] = {}
        self.puts = 0
        self.reads = 0

    def client(self, me: str) -> MemoryStore:
        return MemoryStore(self, me)


class MemoryStore:
    """One author's ``RecordStore`` view of a ``MemoryDHT``."""

    def __init__(self, dht: MemoryDHT, me: str) -> None:
        self.dht, self.me = dht, me
        self.offline = False  # a crashed peer: puts fail, reads see nothing

    def now(self) -> float:
        return self.dht.clock()

    async def put(self, key: str, value: bytes, expires_at: float) -> bool:
        if self.offline:
            return False
        entries = self.dht.data.setdefault(key, {})
        old = entries.get(self.me)
        if old is not None and old[1] >= expires_at:
            return False  # hivemind keeps the value with the later expiration
        entries[self.me] = (bytes(value), float(expires_at))
        self.dht.puts += 1
        return True

    async def read_many(self, keys: Sequence[str]) -> dict[str, list[Entry]]:
        return {key: await self.read(key) for key in dict.fromkeys(keys)}

    async def read(self, key: str) -> list[Entry]:
        if self.offline:
            raise PeerdError("this peer is offline", code=ErrorCode.PEER_UNAVAILABLE)
        self.dht.reads += 1
        now = self.now()
        return [
            Entry(author, value, expires)
            for author, (value, expires) in sorted(self.dht.data.get(key, {}).items())
            if expires > now and (author == self.me or self.dht.rng.random() >= self.dht.miss)
        ]


class Prefetched:
    """A ``RecordStore`` that answers reads of the keys one ``read_many`` fetched from what it
    found, and passes every other read and every put to ``store``.

    A daemon's job loop reads the same few keys each round (the job index, each live job's record
    and progress): fetched together they cost one DHT traversal instead of one each.
    """

    def __init__(self, store: RecordStore, found: Mapping[str, list[Entry]]) -> None:
        self.store, self.found = store, found
        self.me = store.me

    @classmethod
    async def fetch(cls, store: RecordStore, keys: Sequence[str]) -> Prefetched:
        return cls(store, await store.read_many(keys))

    def now(self) -> float:
        return self.store.now()

    async def put(self, key: str, value: bytes, expires_at: float) -> bool:
        return await self.store.put(key, value, expires_at)

    async def read(self, key: str) -> list[Entry]:
        found = self.found.get(key)
        return list(found) if found is not None else await self.store.read(key)

    async def read_many(self, keys: Sequence[str]) -> dict[str, list[Entry]]:
        missing = [k for k in keys if k not in self.found]
        fetched = await self.store.read_many(missing) if missing else {}
        return {k: list(self.found[k]) if k in self.found else fetched[k] for k in dict.fromkeys(keys)}
