"""The v1 peer record: typed dataclasses plus its canonical msgpack codec (spec: protocols/peer-record.md).

Pure: no hivemind, no clocks. ``decode_peer_record`` checks structure only; freshness
against DHT time is ``check_record_time(record, now=...)`` so that tests pass ``now``.
Encoding is canonical (map keys sorted, floats always float64, ``None`` fields
omitted), so one record has exactly one byte string and the test vectors in
``protocols/vectors/peer_record/`` are byte-exact.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import msgpack

from peerd.errors import ErrorCode, ProtocolError

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

_BASE58_RE = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{16,128}$")
_DTYPE_RE = re.compile(r"^[a-z0-9_]{1,16}$")


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


@dataclass(kw_only=True)
class DeviceProfile:
    """What one peer can compute: measured, not declared."""

    name: str  # e.g. "NVIDIA H200" or the CPU model string
    kind: DeviceKind
    memory_total_bytes: int
    memory_free_bytes: int | None  # live at publication time; None where the platform cannot tell
    tflops: dict[str, float] = field(default_factory=dict)  # dense matmul, per dtype ("fp32", "bf16", "fp16")
    measured_at: float  # when the TFLOPS were measured (DHT time, seconds)


@dataclass(kw_only=True)
class LinkMeasurement:
    """One directed link probe result from the record's owner to ``peer_id``."""

    peer_id: str  # libp2p base58 id of the other end
    rtt_ms: float | None = None  # median of small RPC round trips
    bw_up_mbps: float | None = None  # owner -> peer_id, Mbit/s
    bw_down_mbps: float | None = None  # peer_id -> owner, Mbit/s
    measured_at: float  # DHT time of the measurement
    status: LinkStatus = LinkStatus.OK


@dataclass(kw_only=True)
class PeerRecord:
    """The record each peer stores under ``peers_key(swarm)``, subkey = its owner tag."""

    version: int = PROTOCOL_VERSION
    peer_id: str  # libp2p base58 id; must be derived from the owner key that signs the record
    name: str  # human-readable label chosen by the volunteer
    state: PeerState
    maddrs: list[str] = field(default_factory=list)  # multiaddrs others can dial
    profile: DeviceProfile | None = None  # None until the first profile is measured
    links: list[LinkMeasurement] = field(default_factory=list)
    software_version: str  # peerd version string
    started_at: float  # DHT time the daemon started
    updated_at: float  # DHT time this record was produced
    seq: int  # increases with every record the peer publishes during one run


# ---------------------------------------------------------------- encoding


def _profile_to_wire(p: DeviceProfile) -> dict[str, Any]:
    wire: dict[str, Any] = {
        "name": p.name,
        "kind": DeviceKind(p.kind).value,
        "memory_total_bytes": int(p.memory_total_bytes),
        "tflops": {k: float(v) for k, v in sorted(p.tflops.items())},
        "measured_at": float(p.measured_at),
    }
    if p.memory_free_bytes is not None:
        wire["memory_free_bytes"] = int(p.memory_free_bytes)
    return wire


def _link_to_wire(link: LinkMeasurement) -> dict[str, Any]:
    wire: dict[str, Any] = {
        "peer_id": link.peer_id,
        "measured_at": float(link.measured_at),
        "status": LinkStatus(link.status).value,
    }
    for name in ("rtt_ms", "bw_up_mbps", "bw_down_mbps"):
        value = getattr(link, name)
        if value is not None:
            wire[name] = float(value)
    return wire


def peer_record_to_wire(rec: PeerRecord) -> dict[str, Any]:
    """The record as the plain map that goes on the wire (also the JSON form of the test vectors).

    Numbers are coerced (float fields always float64); NaN/inf pass through and are
    rejected by the decode that ``encode_peer_record`` runs on its own output.
    """
    wire: dict[str, Any] = {
        "v": rec.version,
        "kind": PEER_RECORD_KIND,
        "peer_id": rec.peer_id,
        "name": rec.name,
        "state": PeerState(rec.state).value,
        "maddrs": list(rec.maddrs),
        "links": [_link_to_wire(link) for link in rec.links],
        "software_version": rec.software_version,
        "started_at": float(rec.started_at),
        "updated_at": float(rec.updated_at),
        "seq": int(rec.seq),
    }
    if rec.profile is not None:
        wire["profile"] = _profile_to_wire(rec.profile)
    return wire


def _sorted_maps(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _sorted_maps(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [_sorted_maps(x) for x in obj]
    return obj


def canonical_packb(obj: Any) -> bytes:
    """msgpack with map keys sorted (by code point = UTF-8 byte order), float64 floats, str as str type."""
    return msgpack.packb(_sorted_maps(obj), use_bin_type=True, use_single_float=False)


def encode_peer_record(rec: PeerRecord) -> bytes:
    """Canonical msgpack bytes of ``rec``; the result always decodes back to an equal record.

    Raises ``ProtocolError`` if ``rec`` itself would be rejected by ``decode_peer_record``
    (a daemon bug must not reach the DHT, where every peer would reject it anyway).
    """
    if rec.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"cannot encode peer record version {rec.version}", code=ErrorCode.UNSUPPORTED_VERSION
        )
    try:
        raw = canonical_packb(peer_record_to_wire(rec))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"peer record not encodable: {exc}") from None
    decode_peer_record(raw)  # same rules on both sides
    return raw


def fit_peer_record(rec: PeerRecord) -> PeerRecord:
    """``rec`` with its oldest link measurements dropped until it is within MAX_LINKS and MAX_PEER_RECORD_BYTES.

    Large swarms measure more links than one record may carry; the newest ones are the
    most useful to schedulers. Returns ``rec`` itself when it already fits.
    """
    links = sorted(rec.links, key=lambda link: link.measured_at, reverse=True)[:MAX_LINKS]
    while True:
        candidate = rec if len(links) == len(rec.links) else replace(rec, links=links)
        if len(canonical_packb(peer_record_to_wire(candidate))) <= MAX_PEER_RECORD_BYTES or not links:
            return candidate
        # drop ~10% per round: sizes are roughly linear in the number of links
        links = links[: max(0, len(links) - max(1, len(links) // 10))]


# ---------------------------------------------------------------- decoding


def _bad(path: str, why: str, code: ErrorCode = ErrorCode.MALFORMED) -> ProtocolError:
    return ProtocolError(f"peer record: {path}: {why}", code=code)


def _map(obj: Any, path: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise _bad(path, f"expected a map, got {type(obj).__name__}")
    for key in obj:
        if not isinstance(key, str):
            raise _bad(path, f"map keys must be strings, got {type(key).__name__}")
    return obj


def _get(m: dict[str, Any], key: str, path: str, *, optional: bool = False) -> Any:
    value = m.get(key)
    if value is None and not optional:
        raise _bad(f"{path}{key}", "missing")
    return value


def _str(m: dict[str, Any], key: str, path: str, max_chars: int = MAX_TEXT_CHARS) -> str:
    value = _get(m, key, path)
    if not isinstance(value, str):
        raise _bad(f"{path}{key}", f"expected a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise _bad(f"{path}{key}", f"longer than {max_chars} characters")
    return value


def _int(m: dict[str, Any], key: str, path: str) -> int:
    value = _get(m, key, path)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(f"{path}{key}", f"expected a non-negative integer, got {value!r}")
    return value


def _number(value: Any, path: str) -> float:
    # ints are accepted where floats are expected: other encoders may shorten 2.0 to 2
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(path, f"expected a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise _bad(path, f"expected a finite non-negative number, got {value!r}")
    return value


def _opt_number(m: dict[str, Any], key: str, path: str) -> float | None:
    value = _get(m, key, path, optional=True)
    return None if value is None else _number(value, f"{path}{key}")


def _enum(enum_cls: type[StrEnum], m: dict[str, Any], key: str, path: str) -> Any:
    value = _str(m, key, path, max_chars=32)
    try:
        return enum_cls(value)
    except ValueError:
        raise _bad(f"{path}{key}", f"unknown value {value!r}") from None


def _peer_id(m: dict[str, Any], key: str, path: str) -> str:
    value = _str(m, key, path)
    if not _BASE58_RE.fullmatch(value):
        raise _bad(f"{path}{key}", f"{value!r} is not a base58 libp2p peer id")
    return value


def _list(m: dict[str, Any], key: str, path: str, max_items: int) -> list[Any]:
    value = _get(m, key, path, optional=True)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(f"{path}{key}", f"expected a list, got {type(value).__name__}")
    if len(value) > max_items:
        raise _bad(f"{path}{key}", f"more than {max_items} items", ErrorCode.OVERSIZED)
    return value


def _decode_profile(obj: Any, path: str) -> DeviceProfile:
    m = _map(obj, path)
    tflops_raw = _map(_get(m, "tflops", path, optional=True) or {}, f"{path}tflops")
    if len(tflops_raw) > MAX_TFLOPS_ENTRIES:
        raise _bad(f"{path}tflops", f"more than {MAX_TFLOPS_ENTRIES} entries", ErrorCode.OVERSIZED)
    tflops = {}
    for dtype, value in tflops_raw.items():
        if not _DTYPE_RE.fullmatch(dtype):
            raise _bad(f"{path}tflops", f"bad dtype name {dtype!r}")
        tflops[dtype] = _number(value, f"{path}tflops.{dtype}")
    free = _get(m, "memory_free_bytes", path, optional=True)
    return DeviceProfile(
        name=_str(m, "name", path, MAX_NAME_CHARS),
        kind=_enum(DeviceKind, m, "kind", path),
        memory_total_bytes=_int(m, "memory_total_bytes", path),
        memory_free_bytes=None if free is None else _int(m, "memory_free_bytes", path),
        tflops=tflops,
        measured_at=_number(_get(m, "measured_at", path), f"{path}measured_at"),
    )


def _decode_link(obj: Any, path: str) -> LinkMeasurement:
    m = _map(obj, path)
    return LinkMeasurement(
        peer_id=_peer_id(m, "peer_id", path),
        rtt_ms=_opt_number(m, "rtt_ms", path),
        bw_up_mbps=_opt_number(m, "bw_up_mbps", path),
        bw_down_mbps=_opt_number(m, "bw_down_mbps", path),
        measured_at=_number(_get(m, "measured_at", path), f"{path}measured_at"),
        status=_enum(LinkStatus, m, "status", path),
    )


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def unpack_map(raw: bytes, *, max_bytes: int, what: str) -> dict[str, Any]:
    """Size-check and unpack a msgpack map; every failure is a ``ProtocolError`` (no ext types, no trailing bytes)."""
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise ProtocolError(f"{what}: expected bytes, got {type(raw).__name__}")
    if len(raw) > max_bytes:
        raise ProtocolError(
            f"{what}: {len(raw)} bytes exceeds the {max_bytes}-byte limit", code=ErrorCode.OVERSIZED
        )
    try:
        obj = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True, ext_hook=_reject_ext, use_list=True)
    except Exception as exc:  # msgpack raises a zoo (ExtraData, FormatError, StackError, ValueError, ...)
        raise ProtocolError(f"{what}: not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: top level must be a map, got {type(obj).__name__}")
    return obj


def check_header(m: dict[str, Any], kind: str, what: str) -> int:
    """Check the ``v`` / ``kind`` header every peerd message carries; return the version."""
    version = m.get("v")
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProtocolError(f"{what}: missing or non-integer version 'v'")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"{what}: unsupported version {version}", code=ErrorCode.UNSUPPORTED_VERSION)
    got = m.get("kind")
    if not isinstance(got, str):
        raise ProtocolError(f"{what}: missing or non-string 'kind'")
    if got != kind:
        raise ProtocolError(f"{what}: unexpected kind {got[:32]!r}", code=ErrorCode.UNKNOWN_KIND)
    return version


def decode_peer_record(raw: bytes) -> PeerRecord:
    """Decode and structurally validate a peer record; unknown fields are ignored (v1 is extensible).

    Raises ``ProtocolError`` with OVERSIZED, MALFORMED, UNSUPPORTED_VERSION or UNKNOWN_KIND.
    Freshness is a separate check: ``check_record_time``.
    """
    m = unpack_map(raw, max_bytes=MAX_PEER_RECORD_BYTES, what="peer record")
    _map(m, "")
    version = check_header(m, PEER_RECORD_KIND, "peer record")
    maddrs = _list(m, "maddrs", "", MAX_MADDRS)
    for i, addr in enumerate(maddrs):
        if not isinstance(addr, str) or not addr.startswith("/") or len(addr) > MAX_TEXT_CHARS:
            raise _bad(f"maddrs[{i}]", "expected a multiaddr string starting with '/'")
    profile_raw = _get(m, "profile", "", optional=True)
    rec = PeerRecord(
        version=version,
        peer_id=_peer_id(m, "peer_id", ""),
        name=_str(m, "name", "", MAX_NAME_CHARS),
        state=_enum(PeerState, m, "state", ""),
        maddrs=list(maddrs),
        profile=None if profile_raw is None else _decode_profile(profile_raw, "profile."),
        links=[_decode_link(x, f"links[{i}].") for i, x in enumerate(_list(m, "links", "", MAX_LINKS))],
        software_version=_str(m, "software_version", "", 64),
        started_at=_number(_get(m, "started_at", ""), "started_at"),
        updated_at=_number(_get(m, "updated_at", ""), "updated_at"),
        seq=_int(m, "seq", ""),
    )
    if rec.started_at > rec.updated_at:
        raise _bad("started_at", "later than updated_at")
    if len({link.peer_id for link in rec.links}) != len(rec.links):
        raise _bad("links", "more than one measurement for the same peer")
    return rec


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
