"""The v1 peer record: its typed schema and codec (spec: protocols/peer-record.md).

Pure: no hivemind, no clocks. ``decode_peer_record`` checks structure only; freshness
against DHT time is ``check_record_time(record, now=...)`` so that tests pass ``now``.
The schema is declared once below; ``peerd.wire`` encodes it canonically (so the test
vectors in ``protocols/vectors/peer_record/`` are byte-exact) and decodes it strictly.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from peerd.errors import ErrorCode, ProtocolError
from peerd.wire import Schema, WireStruct, canonical_pack, to_builtin
from peerd.wire.types import Count, ElementCosts, HostId, PeerId, PositiveCount, PositiveReal, Real

PROTOCOL_VERSION = 1
PEER_RECORD_KIND = "peer"

# hivemind's DHT process reads its command pipe non-blocking and dies with BlockingIOError
# when a message is split into two writes, which CPython does above 16 KiB
# (hivemind PR #660). Every DHT.store of a record crosses that pipe, so a record stays
# well below it: 12 KiB holds ~70 links (~150 B each) next to the rest of the record.
MAX_PEER_RECORD_BYTES = 12 * 1024
MAX_LINKS = 64
MAX_MADDRS = 16
MAX_TFLOPS_ENTRIES = 16
MAX_NAME_CHARS = 128
MAX_TEXT_CHARS = 256
# hivemind assumes clocks agree within ~3 s; allow a little more before calling a record "from the future".
MAX_CLOCK_SKEW_S = 10.0
# A peer record may not ask the DHT to keep it longer than this after its update
# (a dead peer must vanish within minutes even if it stored a far expiration).
PEER_RECORD_MAX_TTL_S = 600.0


class PeerState(StrEnum):
    JOINING = "joining"  # started, still profiling / probing; not schedulable yet
    ONLINE = "online"  # schedulable
    OFFLINE = "offline"  # left gracefully; the record stays until it expires so others notice quickly


class DeviceKind(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    MPS = "mps"


class LinkStatus(StrEnum):
    OK = "ok"  # measured; the numbers are valid
    UNREACHABLE = "unreachable"  # could not open a stream to the peer
    TIMEOUT = "timeout"  # connected, but the probe did not finish within its deadline
    BUSY = "busy"  # the peer refused the probe (its probe budget is spent)
    ERROR = "error"  # the peer answered with something malformed


_DtypeName = Annotated[str, Meta(pattern=r"^[a-z0-9_]{1,16}$")]
_Multiaddr = Annotated[str, Meta(pattern=r"^/", max_length=MAX_TEXT_CHARS)]


class DeviceProfile(WireStruct, kw_only=True):
    """What one peer can compute: measured, not declared."""

    name: Annotated[str, Meta(max_length=MAX_NAME_CHARS)]  # e.g. "NVIDIA H200" or the CPU model string
    kind: DeviceKind
    memory_total_bytes: Count
    memory_free_bytes: Count | None = None  # live at publication time; None where the platform cannot tell
    # dense matmul, per dtype ("fp32", "bf16", "fp16")
    tflops: Annotated[dict[_DtypeName, Real], Meta(max_length=MAX_TFLOPS_ENTRIES)] = msgspec.field(
        default_factory=dict
    )
    measured_at: Real  # when the TFLOPS were measured (DHT time, seconds)
    memory_gb_s: PositiveReal | None = (
        None  # measured device-memory copy bandwidth (GB/s); absent from older peers
    )
    launch_us: PositiveReal | None = (
        None  # measured µs per dispatched op (small models); absent from older peers
    )
    # A CPU device's machine and its share of it (peers on one machine share its cores); all three
    # or none, absent for accelerators and older peers
    host_id: HostId | None = None
    host_cores: PositiveCount | None = None  # cores available to this peer's process
    threads: PositiveCount | None = None  # compute threads its rates were measured with
    # measured ns per unit of the ops that cost more than their launch and traffic
    # (peerd.models.launches.ELEMENT_FAMILIES); absent from older peers
    element_ns: ElementCosts | None = None
    # measured host CPU per message at one end (its daemon and its p2pd), µs, and per payload byte,
    # ns: what messaging costs a machine's cores (peerd.pipeline.messaging); absent from older peers
    message_us: PositiveReal | None = None
    wire_byte_ns: PositiveReal | None = None
    # measured host CPU per call of a compressing boundary codec, µs, and per value it encodes or
    # decodes, ns (peerd.pipeline.messaging); absent from older peers
    codec_us: PositiveReal | None = None
    codec_value_ns: PositiveReal | None = None
    # cores its daemon, DHT and p2pd keep busy while working for no job, measured live; absent
    # until measured and from older peers
    idle_cores: PositiveReal | None = None


class LinkMeasurement(WireStruct, kw_only=True):
    """One directed link probe result from the record's owner to ``peer_id``."""

    peer_id: PeerId  # libp2p base58 id of the other end
    rtt_ms: Real | None = None  # median of small RPC round trips
    bw_up_mbps: Real | None = None  # owner -> peer_id, Mbit/s
    bw_down_mbps: Real | None = None  # peer_id -> owner, Mbit/s
    measured_at: Real  # DHT time of the measurement
    status: LinkStatus = LinkStatus.OK

    # The record carries ms and Mbit/s (peer-record.md, readable in a dump); code reads and writes SI.
    @classmethod
    def from_si(
        cls,
        peer_id: str,
        *,
        rtt_s: float | None,
        bw_up_bps: float | None,
        bw_down_bps: float | None,
        measured_at: float,
        status: LinkStatus = LinkStatus.OK,
    ) -> LinkMeasurement:
        return cls(
            peer_id=peer_id,
            rtt_ms=scaled(rtt_s, 1e3),
            bw_up_mbps=scaled(bw_up_bps, 1e-6),
            bw_down_mbps=scaled(bw_down_bps, 1e-6),
            measured_at=measured_at,
            status=status,
        )

    @property
    def rtt_s(self) -> float | None:
        return scaled(self.rtt_ms, 1e-3)

    @property
    def bw_up_bps(self) -> float | None:
        return scaled(self.bw_up_mbps, 1e6)

    @property
    def bw_down_bps(self) -> float | None:
        return scaled(self.bw_down_mbps, 1e6)


def scaled(value: float | None, factor: float) -> float | None:
    """An optional measurement in other units (the records carry ms, Mbit/s, µs; code reads SI)."""
    return None if value is None else value * factor


class PeerRecord(WireStruct, kw_only=True, tag_field="kind", tag=PEER_RECORD_KIND):
    """The record each peer stores under ``peers_key(swarm)``, subkey = its owner tag."""

    version: int = msgspec.field(default=PROTOCOL_VERSION, name="v")
    peer_id: PeerId  # must be derived from the owner key that signs the record
    name: Annotated[str, Meta(max_length=MAX_NAME_CHARS)]  # human-readable label chosen by the volunteer
    state: PeerState
    maddrs: Annotated[list[_Multiaddr], Meta(max_length=MAX_MADDRS)] = msgspec.field(default_factory=list)
    profile: DeviceProfile | None = None  # None until the first profile is measured
    links: Annotated[list[LinkMeasurement], Meta(max_length=MAX_LINKS)] = msgspec.field(default_factory=list)
    software_version: Annotated[str, Meta(max_length=64)]  # peerd version string
    started_at: Real  # DHT time the daemon started
    updated_at: Real  # DHT time this record was produced
    seq: Count  # increases with every record the peer publishes during one run


def _record_rules(rec: PeerRecord) -> None:
    if rec.started_at > rec.updated_at:
        raise _bad("started_at", "later than updated_at")
    if len({link.peer_id for link in rec.links}) != len(rec.links):
        raise _bad("links", "more than one measurement for the same peer")


def _bad(path: str, why: str, code: ErrorCode = ErrorCode.MALFORMED) -> ProtocolError:
    return ProtocolError(f"peer record: {path}: {why}", code=code)


PEER_RECORD = Schema(
    PeerRecord,
    "peer record",
    MAX_PEER_RECORD_BYTES,
    version=PROTOCOL_VERSION,
    kind="peer",
    rules=_record_rules,
)


def peer_record_to_wire(rec: PeerRecord) -> dict[str, Any]:
    """The record as the plain map that goes on the wire (also the JSON form of the test vectors)."""
    return to_builtin(PEER_RECORD.decode(PEER_RECORD.encode(rec)))


def encode_peer_record(rec: PeerRecord) -> bytes:
    """Canonical msgpack bytes of ``rec``; raises ``ProtocolError`` where a receiver would reject it."""
    if rec.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"cannot encode peer record version {rec.version}", code=ErrorCode.UNSUPPORTED_VERSION
        )
    return PEER_RECORD.encode(rec)


def fit_peer_record(rec: PeerRecord) -> PeerRecord:
    """``rec`` with its oldest link measurements dropped until it is within MAX_LINKS and MAX_PEER_RECORD_BYTES.

    Large swarms measure more links than one record may carry; the newest ones are the
    most useful to schedulers. Returns ``rec`` itself when it already fits.
    """
    links = sorted(rec.links, key=lambda link: link.measured_at, reverse=True)[:MAX_LINKS]
    while True:
        candidate = rec if len(links) == len(rec.links) else msgspec.structs.replace(rec, links=links)
        if len(canonical_pack(candidate)) <= MAX_PEER_RECORD_BYTES or not links:
            return candidate
        # drop ~10% per round: sizes are roughly linear in the number of links
        links = links[: max(0, len(links) - max(1, len(links) // 10))]


def decode_peer_record(raw: bytes) -> PeerRecord:
    """Decode and structurally validate a peer record; unknown fields are ignored (v1 is extensible).

    Raises ``ProtocolError`` with OVERSIZED, MALFORMED, UNSUPPORTED_VERSION or UNKNOWN_KIND.
    Freshness is a separate check: ``check_record_time``.
    """
    return PEER_RECORD.decode(raw)


# ---------------------------------------------------------------- freshness


def check_record_time(
    rec: PeerRecord,
    now: float,
    *,
    expiration_time: float | None = None,
    max_skew_s: float = MAX_CLOCK_SKEW_S,
    max_ttl_s: float = PEER_RECORD_MAX_TTL_S,
) -> None:
    """Reject a record whose clocks disagree with DHT time ``now``.

    FROM_FUTURE: any timestamp (updated_at, profile/link measured_at) later than
    ``now + max_skew_s``, or a DHT expiration more than ``max_ttl_s`` after updated_at.
    STALE: updated_at older than ``now - max_ttl_s - max_skew_s`` (no honest peer keeps
    such a record alive), or an expiration already in the past.
    """
    limit = now + max_skew_s
    stamps = [("updated_at", rec.updated_at)]
    if rec.profile is not None:
        stamps.append(("profile.measured_at", rec.profile.measured_at))
    stamps += [(f"links[{i}].measured_at", link.measured_at) for i, link in enumerate(rec.links)]
    for name, stamp in stamps:
        if stamp > limit:
            raise _bad(
                name,
                f"{stamp - now:.1f} s ahead of DHT time (skew limit {max_skew_s} s)",
                ErrorCode.FROM_FUTURE,
            )
    if rec.updated_at < now - max_ttl_s - max_skew_s:
        raise _bad("updated_at", f"{now - rec.updated_at:.1f} s old (limit {max_ttl_s} s)", ErrorCode.STALE)
    if expiration_time is not None:
        if expiration_time > rec.updated_at + max_ttl_s + max_skew_s:
            raise _bad(
                "expiration",
                f"expires {expiration_time - rec.updated_at:.1f} s after its update (TTL limit {max_ttl_s} s)",
                ErrorCode.FROM_FUTURE,
            )
        if expiration_time < now - max_skew_s:
            raise _bad("expiration", "already expired", ErrorCode.STALE)


def validate_peer_record(raw: bytes, now: float, *, expiration_time: float | None = None) -> PeerRecord:
    """``decode_peer_record`` followed by ``check_record_time``: the full check a receiver runs."""
    rec = decode_peer_record(raw)
    check_record_time(rec, now, expiration_time=expiration_time)
    return rec
