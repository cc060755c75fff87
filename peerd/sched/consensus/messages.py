"""Planning-consensus wire messages (v1): their schemas on ``peerd.wire``, codec and digests.

Spec and byte-exact vectors: ``protocols/consensus.md``, ``protocols/vectors/consensus/``.
Each message is declared once below as a msgspec Struct; ``peerd.wire`` writes it
canonically (sorted keys, float64) and decodes it strictly: unknown keys are ignored (and
not covered by any hash), missing or mistyped known keys raise ``ProtocolError`` naming
the field. Authenticity is not checked here: the DHT layer's signature validator
guarantees that ``peer`` / ``author`` / ``voter`` wrote the record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any, ClassVar, Final, Literal, TypeVar, overload

from msgspec import Meta
from msgspec.structs import force_setattr, replace

from peerd.errors import ConfigError, ErrorCode, ProtocolError
from peerd.sched.allocation import Allocation
from peerd.wire import FrozenWireStruct, Schema, canonical_pack, check_envelope, decode_map, sha256
from peerd.wire.types import Count, ElementCosts, Hash32, HostId, PositiveCount, PositiveReal, Real

VERSION: Final = 1

# Size caps per kind, well under hivemind's 4 MiB unary-message limit.
MAX_BYTES = {"roster": 256 << 10, "candidate": 256 << 10, "vote": 4 << 10, "commit": 2 << 20}

Id = Annotated[str, Meta(min_length=1)]
"""A job or peer id: any non-empty str (the spec sets no other bound; the byte limit bounds it)."""
Round = Annotated[int, Meta(ge=0, le=1)]

# The messages are frozen like every value the machine keeps. ``dict=True`` gives the two with a
# cached digest (``hash``, ``id``) the __dict__ that cached_property needs.


class RosterDevice(FrozenWireStruct, frozen=True):
    """What a roster entry declares to the cost model about its author's device (SI units)."""

    tflops: Real  # measured dense throughput
    memory_bytes: Count  # usable accelerator memory
    region: str = ""  # free-form label (clustering seed), "" when unknown
    memory_bandwidth: PositiveReal | None = None  # measured bytes/s of a device-memory copy (RL decode cost)
    launch_s: PositiveReal | None = None  # measured seconds per dispatched op (RL cost of small models)
    # a CPU device's machine, its cores and compute threads (peers on one machine share its cores)
    host: HostId | None = None
    host_cores: PositiveCount | None = None
    threads: PositiveCount | None = None
    # seconds per unit of the ops that cost more than their launch and traffic (RL cost of small models)
    element_s: ElementCosts | None = None
    # host CPU seconds per message at one end and per payload byte (what messaging costs its machine)
    message_s: PositiveReal | None = None
    wire_byte_s: PositiveReal | None = None
    idle_cores: PositiveReal | None = None  # cores its daemon keeps busy while working for no job
    # host CPU seconds per call of a compressing boundary codec and per value it codes
    codec_s: PositiveReal | None = None
    codec_value_s: PositiveReal | None = None


class RosterLink(FrozenWireStruct, frozen=True):
    """One measured link from the entry's author to ``peer``, as the cost model uses it (SI units)."""

    peer: Id
    delay_s: Real  # one-way latency estimate (RTT / 2)
    bandwidth_bps: PositiveReal  # bits per second


MAX_HELD_STEPS = 16


class HeldState(FrozenWireStruct, frozen=True):
    """Training state of one stage its author can serve to others: the steps it holds, for one layer range.

    A running job's roster entries carry these, so the re-plan's resume step is a function of
    the committed roster alone (every peer derives the same one): the newest step that some
    member holds for every stage.
    """

    stage: Count
    layers: tuple[Count, Count]  # [start, end) of the model's layers this stage holds
    steps: Annotated[tuple[Count, ...], Meta(max_length=MAX_HELD_STEPS)]  # ascending


class RosterEntry(FrozenWireStruct, frozen=True, dict=True, tag_field="kind", tag="roster"):
    """A peer's application to plan epoch ``epoch`` of job ``job``: its device, its links, the state it holds."""

    KIND: ClassVar[str] = "roster"
    job: Id
    epoch: Count
    peer: Id
    issued_at: Real  # author's DHT time
    profile: RosterDevice
    links: tuple[RosterLink, ...]  # sorted by peer, at most one per peer (encode sorts them)
    # stage state held for a re-plan (sorted by stage, layers); absent on the wire when empty
    held: Annotated[tuple[HeldState, ...], Meta(max_length=MAX_HELD_STEPS)] = ()
    version: Literal[1] = VERSION

    @cached_property
    def hash(self) -> bytes:
        """sha256 of the canonical encoding: what roster digests are built from."""
        return sha256(encode(self))


class Candidate(FrozenWireStruct, frozen=True, dict=True, tag_field="kind", tag="candidate"):
    """An island's allocation for epoch ``epoch``, with the cost its author claims on the named roster."""

    KIND: ClassVar[str] = "candidate"
    job: Id
    epoch: Count
    author: Id
    issued_at: Real
    allocation: Allocation  # its fields are the wire form: stages, spares, layers (nil: even split)
    cost: Real  # claimed; receivers re-score and reject a mismatch
    members: tuple[Id, ...]  # sorted peer ids of the roster the cost refers to
    roster_digest: Hash32  # roster_digest() of those members' entries
    version: Literal[1] = VERSION

    def __post_init__(self) -> None:
        # Replica order carries no meaning: keep the canonical form so equal candidates compare
        # equal. Stages of unequal width have none; the schema's rules reject them.
        if len({len(stage) for stage in self.allocation.stages}) == 1:
            force_setattr(self, "allocation", self.allocation.canonical())

    @cached_property
    def id(self) -> bytes:
        return candidate_id(self.roster_digest, self.allocation)


class Vote(FrozenWireStruct, frozen=True, tag_field="kind", tag="vote"):
    """``voter``'s vote in round ``round`` (0: best re-scored, 1: adoption after a split)."""

    KIND: ClassVar[str] = "vote"
    job: Id
    epoch: Count
    round: Round
    voter: Id
    issued_at: Real
    candidate: Hash32  # candidate id
    cost: Real  # the voter's re-score of that candidate
    roster_digest: Hash32  # digest of the voter's whole roster view (quorums count within one view)
    version: Literal[1] = VERSION


class CommitRecord(FrozenWireStruct, frozen=True, tag_field="kind", tag="commit"):
    """Proof of a commit: the candidate, the committer's roster view and a quorum of its votes.

    Self-verifying: ``roster`` lists ``(peer, entry_hash)`` so a reader can recompute the
    digest the votes name without holding the entries. The driver must pass only records
    whose embedded votes it authenticated (they are signed DHT records of their voters).
    """

    KIND: ClassVar[str] = "commit"
    job: Id
    epoch: Count
    round: Round
    author: Id
    issued_at: Real
    candidate: Candidate
    roster: tuple[tuple[Id, Hash32], ...]  # sorted by peer (encode sorts it)
    votes: tuple[Vote, ...]  # encode sorts them by voter
    version: Literal[1] = VERSION


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


# --- digests -----------------------------------------------------------------------------------


def allocation_hash(allocation: Allocation) -> bytes:
    """The scheduler's canonical allocation digest (``Allocation.digest``), as 32 bytes."""
    return bytes.fromhex(allocation.digest())


def candidate_id(roster_digest: bytes, allocation: Allocation) -> bytes:
    """Identity voted on: the same allocation scored on another roster is another candidate."""
    return sha256(canonical_pack([roster_digest, allocation_hash(allocation)]))


def roster_digest(refs: tuple[tuple[str, bytes], ...] | list[tuple[str, bytes]]) -> bytes:
    """Digest of a roster given ``(peer, entry_hash)`` pairs (order-independent)."""
    return sha256(canonical_pack([[peer, h] for peer, h in sorted(refs)]))


# --- checks across fields (run on decode and on encode) ---------------------------------------


def _sorted_unique(keys: list[str] | tuple[str, ...], what: str, field: str, why: str) -> None:
    if list(keys) != sorted(set(keys)):
        raise ProtocolError(f"{what}: {field}: {why}")


def _entry_rules(e: RosterEntry) -> None:
    what = "consensus roster entry"
    peers = [link.peer for link in e.links]
    _sorted_unique(peers, what, "links", "must be sorted by peer, one per peer")
    keys = [(h.stage, h.layers) for h in e.held]
    if keys != sorted(set(keys)):
        raise ProtocolError(f"{what}: held: must be sorted by (stage, layers), one per pair")
    for i, h in enumerate(e.held):
        if not h.layers[0] < h.layers[1]:
            raise ProtocolError(f"{what}: held[{i}].layers: start must be below end")
        if list(h.steps) != sorted(set(h.steps)):
            raise ProtocolError(f"{what}: held[{i}].steps: must be ascending and unique")


def _candidate_rules(c: Candidate, what: str = "consensus candidate", at: str = "") -> None:
    _sorted_unique(c.members, what, f"{at}members", "peer ids must be sorted and unique")
    a = c.allocation
    try:
        Allocation.from_plain(a.stages, a.spares, a.layers)
    except ConfigError as exc:
        raise ProtocolError(f"{what}: {at}allocation.{exc.field}: {exc.detail}") from None
    if not set(a.devices) | set(a.spares) <= set(c.members):
        raise ProtocolError(f"{what}: {at}allocation: uses a peer that is not in members")


def _commit_rules(r: CommitRecord) -> None:
    what = "consensus commit record"
    _sorted_unique([p for p, _ in r.roster], what, "roster", "must be sorted by peer, one per peer")
    _candidate_rules(r.candidate, what, "candidate.")


def _schema(
    cls: type[Any], what: str, rules: Callable[[Any], None] | None = None, omit: frozenset[str] = frozenset()
) -> Schema[Any]:
    return Schema(cls, what, MAX_BYTES[cls.KIND], VERSION, cls.KIND, "version", rules, omit)


SCHEMAS: dict[str, Schema[Any]] = {
    "roster": _schema(RosterEntry, "consensus roster entry", _entry_rules, frozenset({"held"})),
    "candidate": _schema(Candidate, "consensus candidate", _candidate_rules),
    "vote": _schema(Vote, "consensus vote"),
    "commit": _schema(CommitRecord, "consensus commit record", _commit_rules),
}


# --- codec -------------------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    """Canonical bytes of ``msg`` (equal messages give equal bytes); ``ProtocolError`` where a receiver would refuse it."""
    if isinstance(msg, RosterEntry):
        links = tuple(sorted(msg.links, key=lambda link: link.peer))
        msg = replace(msg, links=links, held=tuple(sorted(msg.held, key=lambda h: (h.stage, h.layers))))
    elif isinstance(msg, CommitRecord):
        msg = replace(
            msg, roster=tuple(sorted(msg.roster)), votes=tuple(sorted(msg.votes, key=lambda v: v.voter))
        )
    return SCHEMAS[msg.KIND].encode(msg)


# A message class passed as ``expect`` types the decoded result.
M = TypeVar("M", bound=Message)


@overload
def decode(data: bytes, expect: type[M]) -> M: ...
@overload
def decode(data: bytes, expect: None = None) -> Message: ...
def decode(data: bytes, expect: type[M] | None = None) -> Message:
    """Parse bytes into a message; ``expect`` restricts the kind. Raises ``ProtocolError``."""
    what = "consensus message"
    m = decode_map(data, max_bytes=max(MAX_BYTES.values()), what=what)
    check_envelope(m, what=what, version=VERSION, kind=None, version_field="version")
    kind = m.get("kind")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"{what}: unknown kind {str(kind)[:32]!r}", code=ErrorCode.UNKNOWN_KIND)
    if expect is not None and schema.cls is not expect:
        raise ProtocolError(f"{what}: expected kind {expect.KIND!r}, got {kind!r}")
    if len(data) > schema.max_bytes:
        raise ProtocolError(
            f"{schema.what}: {len(data)} bytes exceeds the {schema.max_bytes}-byte limit",
            code=ErrorCode.OVERSIZED,
        )
    msg: Message = schema.check(m)
    return msg
