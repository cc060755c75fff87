"""Planning-consensus wire messages (v1): typed dataclasses and their canonical msgpack codec.

Spec and byte-exact vectors: ``protocols/consensus.md``, ``protocols/vectors/consensus/``.
Every message is a msgpack map with ``version`` and ``kind``, keys in sorted order
(``wire``). Decoding is tolerant within v1: unknown keys are ignored (and not
covered by any hash), missing or mistyped known keys raise ``ProtocolError``.
Authenticity is not checked here: the DHT layer's signature validator guarantees that
``peer`` / ``author`` / ``voter`` wrote the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, TypeVar, overload

import msgpack

from peerd.errors import ErrorCode, ProtocolError
from peerd.sched.allocation import Allocation
from peerd.sched.consensus.wire import (
    Fields,
    allocation_from_wire,
    allocation_to_wire,
    candidate_id,
    malformed,
    pack,
    roster_digest,
    sha,
    sorted_map,
)

VERSION = 1

# Size caps per kind, well under hivemind's 4 MiB unary-message limit.
MAX_BYTES = {"roster": 256 << 10, "candidate": 256 << 10, "vote": 4 << 10, "commit": 2 << 20}


# --- messages ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceProfile:
    """What the cost model needs to know about a peer's device."""

    tflops: float  # measured dense throughput
    memory_bytes: int  # usable accelerator memory
    region: str = ""  # free-form label (clustering seed), "" when unknown

    def to_wire(self) -> dict[str, Any]:
        return sorted_map(
            {"tflops": float(self.tflops), "memory_bytes": self.memory_bytes, "region": self.region}
        )

    @classmethod
    def from_wire(cls, m: Any) -> DeviceProfile:
        f = Fields(m, "profile")
        region = f.m.get("region", "")
        if not isinstance(region, str):
            raise malformed("profile.region", "must be a string")
        return cls(f.number("tflops"), f.uint("memory_bytes"), region)


@dataclass(frozen=True)
class LinkMeasurement:
    """One measured link from the entry's author to ``peer``."""

    peer: str
    delay_s: float  # one-way latency estimate (RTT / 2)
    bandwidth_bps: float  # bits per second

    def to_wire(self) -> dict[str, Any]:
        return sorted_map(
            {"peer": self.peer, "delay_s": float(self.delay_s), "bandwidth_bps": float(self.bandwidth_bps)}
        )

    @classmethod
    def from_wire(cls, m: Any) -> LinkMeasurement:
        f = Fields(m, "links[]")
        return cls(f.text("peer"), f.number("delay_s"), f.number("bandwidth_bps", positive=True))


@dataclass(frozen=True)
class RosterEntry:
    """A peer's application to plan epoch ``epoch`` of job ``job``: its device and its links."""

    KIND: ClassVar[str] = "roster"
    job: str
    epoch: int
    peer: str
    issued_at: float  # author's DHT time
    profile: DeviceProfile
    links: tuple[LinkMeasurement, ...] = ()  # sorted by peer, at most one per peer

    def body(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "epoch": self.epoch,
            "peer": self.peer,
            "issued_at": float(self.issued_at),
            "profile": self.profile.to_wire(),
            "links": [link.to_wire() for link in sorted(self.links, key=lambda x: x.peer)],
        }

    @classmethod
    def from_body(cls, f: Fields) -> RosterEntry:
        links = tuple(LinkMeasurement.from_wire(x) for x in f.array("links"))
        peers = [x.peer for x in links]
        if peers != sorted(set(peers)):
            raise malformed("links", "must be sorted by peer, one per peer")
        return cls(
            f.text("job"),
            f.uint("epoch"),
            f.text("peer"),
            f.number("issued_at"),
            DeviceProfile.from_wire(f.get("profile")),
            links,
        )

    @cached_property
    def hash(self) -> bytes:
        """sha256 of the canonical encoding: what roster digests are built from."""
        return sha(encode(self))


@dataclass(frozen=True)
class Candidate:
    """An island's allocation for epoch ``epoch``, with the cost its author claims on the named roster."""

    KIND: ClassVar[str] = "candidate"
    job: str
    epoch: int
    author: str
    issued_at: float
    allocation: Allocation
    cost: float  # claimed; receivers re-score and reject a mismatch
    members: tuple[str, ...]  # sorted peer ids of the roster the cost refers to
    roster_digest: bytes  # roster_digest() of those members' entries

    def __post_init__(self) -> None:
        # Replica order carries no meaning: keep the canonical form so equal candidates compare equal.
        object.__setattr__(self, "allocation", self.allocation.canonical())

    def body(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "epoch": self.epoch,
            "author": self.author,
            "issued_at": float(self.issued_at),
            "allocation": allocation_to_wire(self.allocation),
            "cost": float(self.cost),
            "members": list(self.members),
            "roster_digest": self.roster_digest,
        }

    @classmethod
    def from_body(cls, f: Fields) -> Candidate:
        allocation = allocation_from_wire(f.get("allocation"), f.name("allocation"))
        members = f.peers("members", sorted_unique=True)
        if not set(allocation.devices) | set(allocation.spares) <= set(members):
            raise malformed(f.name("allocation"), "uses a peer that is not in members")
        return cls(
            f.text("job"),
            f.uint("epoch"),
            f.text("author"),
            f.number("issued_at"),
            allocation,
            f.number("cost"),
            members,
            f.hash("roster_digest"),
        )

    @cached_property
    def id(self) -> bytes:
        return candidate_id(self.roster_digest, self.allocation)


@dataclass(frozen=True)
class Vote:
    """``voter``'s vote in round ``round`` (0: best re-scored, 1: adoption after a split)."""

    KIND: ClassVar[str] = "vote"
    job: str
    epoch: int
    round: int
    voter: str
    issued_at: float
    candidate: bytes  # candidate id
    cost: float  # the voter's re-score of that candidate
    roster_digest: bytes  # digest of the voter's whole roster view (quorums count within one view)

    def body(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "epoch": self.epoch,
            "round": self.round,
            "voter": self.voter,
            "issued_at": float(self.issued_at),
            "candidate": self.candidate,
            "cost": float(self.cost),
            "roster_digest": self.roster_digest,
        }

    @classmethod
    def from_body(cls, f: Fields) -> Vote:
        return cls(
            f.text("job"),
            f.uint("epoch"),
            f.uint("round", hi=1),
            f.text("voter"),
            f.number("issued_at"),
            f.hash("candidate"),
            f.number("cost"),
            f.hash("roster_digest"),
        )


@dataclass(frozen=True)
class CommitRecord:
    """Proof of a commit: the candidate, the committer's roster view and a quorum of its votes.

    Self-verifying: ``roster`` lists ``(peer, entry_hash)`` so a reader can recompute the
    digest the votes name without holding the entries. The driver must pass only records
    whose embedded votes it authenticated (they are signed DHT records of their voters).
    """

    KIND: ClassVar[str] = "commit"
    job: str
    epoch: int
    round: int
    author: str
    issued_at: float
    candidate: Candidate
    roster: tuple[tuple[str, bytes], ...]  # sorted by peer
    votes: tuple[Vote, ...]

    def body(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "epoch": self.epoch,
            "round": self.round,
            "author": self.author,
            "issued_at": float(self.issued_at),
            "candidate": _envelope(self.candidate),
            "roster": [[p, h] for p, h in sorted(self.roster)],
            "votes": [_envelope(v) for v in sorted(self.votes, key=lambda v: v.voter)],
        }

    @classmethod
    def from_body(cls, f: Fields) -> CommitRecord:
        roster = []
        for item in f.array("roster"):
            ok = isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and item[0]
            if not ok or not isinstance(item[1], bytes) or len(item[1]) != 32:
                raise malformed("roster[]", "must be [peer id, 32-byte entry hash]")
            roster.append((item[0], item[1]))
        if [p for p, _ in roster] != sorted({p for p, _ in roster}):
            raise malformed("roster", "must be sorted by peer, one per peer")
        return cls(
            f.text("job"),
            f.uint("epoch"),
            f.uint("round", hi=1),
            f.text("author"),
            f.number("issued_at"),
            _from_envelope(f.get("candidate"), Candidate, "candidate"),
            tuple(roster),
            tuple(_from_envelope(v, Vote, "votes[]") for v in f.array("votes")),
        )


@dataclass(frozen=True)
class Roster:
    """A frozen roster view: the entries one peer accepted for an epoch, sorted by peer."""

    epoch: int
    entries: tuple[RosterEntry, ...]

    @classmethod
    def of(cls, epoch: int, entries: list[RosterEntry] | tuple[RosterEntry, ...]) -> Roster:
        return cls(epoch, tuple(sorted(entries, key=lambda e: e.peer)))

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(e.peer for e in self.entries)

    @cached_property
    def refs(self) -> tuple[tuple[str, bytes], ...]:
        return tuple((e.peer, e.hash) for e in self.entries)

    @cached_property
    def digest(self) -> bytes:
        return roster_digest(self.refs)

    def entry(self, peer: str) -> RosterEntry | None:
        return next((e for e in self.entries if e.peer == peer), None)

    def subset(self, peers: tuple[str, ...] | list[str]) -> Roster | None:
        """The sub-roster of ``peers``, or None if this view lacks one of them."""
        wanted = set(peers)
        picked = [e for e in self.entries if e.peer in wanted]
        return Roster(self.epoch, tuple(picked)) if len(picked) == len(wanted) else None


Message = RosterEntry | Candidate | Vote | CommitRecord
KINDS: dict[str, type[Message]] = {c.KIND: c for c in (RosterEntry, Candidate, Vote, CommitRecord)}


def _envelope(msg: Message) -> dict[str, Any]:
    return sorted_map({"version": VERSION, "kind": msg.KIND, **msg.body()})


# A message class passed as ``expect`` types the decoded result.
M = TypeVar("M", bound=Message)


@overload
def _from_envelope(m: Any, expect: type[M], where: str) -> M: ...
@overload
def _from_envelope(m: Any, expect: None, where: str) -> Message: ...
def _from_envelope(m: Any, expect: type[M] | None, where: str) -> Message:
    f = Fields(m, where)
    version = f.m.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise malformed(f.name("version"), f"must be an integer, got {version!r}")
    if version != VERSION:
        raise ProtocolError(
            f"consensus message version {version} (this peer speaks {VERSION})",
            code=ErrorCode.UNSUPPORTED_VERSION,
        )
    kind = f.m.get("kind")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown consensus message kind {kind!r}", code=ErrorCode.UNKNOWN_KIND)
    if expect is not None and cls is not expect:
        raise malformed(where or "kind", f"expected kind {expect.KIND!r}, got {kind!r}")
    return cls.from_body(f)


def encode(msg: Message) -> bytes:
    """Canonical bytes of ``msg`` (equal messages give equal bytes)."""
    data = pack(_envelope(msg))
    if len(data) > MAX_BYTES[msg.KIND]:
        raise ProtocolError(
            f"{msg.KIND} message is {len(data)} bytes (limit {MAX_BYTES[msg.KIND]})", code=ErrorCode.OVERSIZED
        )
    return data


@overload
def decode(data: bytes, expect: type[M]) -> M: ...
@overload
def decode(data: bytes, expect: None = None) -> Message: ...
def decode(data: bytes, expect: type[M] | None = None) -> Message:
    """Parse bytes into a message; ``expect`` restricts the kind. Raises ``ProtocolError``."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise malformed("", f"message must be bytes, got {type(data).__name__}")
    if len(data) > max(MAX_BYTES.values()):
        raise ProtocolError(f"consensus message of {len(data)} bytes is too large", code=ErrorCode.OVERSIZED)
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, use_list=True, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise ProtocolError(
            f"consensus message is not valid msgpack: {exc}", code=ErrorCode.MALFORMED
        ) from None
    msg = _from_envelope(obj, expect, "")
    if len(data) > MAX_BYTES[msg.KIND]:
        raise ProtocolError(
            f"{msg.KIND} message is {len(data)} bytes (limit {MAX_BYTES[msg.KIND]})", code=ErrorCode.OVERSIZED
        )
    return msg
