"""Regenerate the peer-record test vectors in protocols/vectors/peer_record/ (spec: protocols/peer-record.md).

    python scripts/gen_protocol_vectors.py           # rewrite the vector files
    python scripts/gen_protocol_vectors.py --check   # exit 1 if the committed files differ

Tests never run this: they check the committed files against the codec, so a codec
change that alters bytes fails the tests until someone regenerates on purpose (and
bumps the protocol version if the change is not backward compatible).

Vector kinds (field "type"):
  encode  -- "record" (the wire map as JSON) encodes to exactly "msgpack_hex" and decodes back to it
  decode  -- "msgpack_hex" is accepted (tolerated variations); it decodes to "record", re-encodes to "canonical_hex"
  reject  -- decoding "msgpack_hex" fails with "error" (an ErrorCode name)
  time    -- "msgpack_hex" decodes, then the freshness check at DHT time "now" (and the entry's
             "expiration_time", if given) gives "error", or accepts it when "error" is null
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import msgpack
import msgspec

from peerd.errors import ErrorCode, PeerdError
from peerd.swarm.records import (
    MAX_LINKS,
    MAX_PEER_RECORD_BYTES,
    check_record_time,
    decode_peer_record,
    encode_peer_record,
    peer_record_to_wire,
)
from peerd.wire import canonical_pack

OUT = Path(__file__).resolve().parents[1] / "protocols" / "vectors" / "peer_record"
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z: every timestamp below is T0 + a small offset
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def fake_peer_id(seed: str) -> str:
    """A well-formed libp2p peer id (base58 sha2-256 multihash) derived from ``seed``: stable across runs."""
    n = int.from_bytes(bytes([0x12, 0x20]) + hashlib.sha256(seed.encode()).digest(), "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = _B58[r] + out
    return out


PEER_A, PEER_B, PEER_C, PEER_D = (fake_peer_id(s) for s in ("peer-a", "peer-b", "peer-c", "peer-d"))


def base(**changes: Any) -> dict[str, Any]:
    wire: dict[str, Any] = {
        "v": 1,
        "kind": "peer",
        "peer_id": PEER_A,
        "name": "alice-laptop",
        "state": "online",
        "maddrs": ["/ip4/203.0.113.7/tcp/31337"],
        "links": [],
        "software_version": "0.1.0",
        "started_at": T0,
        "updated_at": T0 + 30.0,
        "seq": 3,
        "profile": {
            "name": "AMD EPYC 7B13",
            "kind": "cpu",
            "memory_total_bytes": 16 * 2**30,
            "memory_free_bytes": 9 * 2**30,
            "tflops": {"fp32": 0.19, "bf16": 0.42},
            "measured_at": T0 + 2.5,
        },
    }
    wire.update(changes)
    return wire


def link(peer: str, **fields: Any) -> dict[str, Any]:
    return {"peer_id": peer, "measured_at": T0 + 20.0, "status": "ok", **fields}


SHARED_CPU_PROFILE = {
    **base()["profile"],
    "launch_us": 3.08,
    "host_id": "f448a7fc47f1841a",
    "host_cores": 2,
    "threads": 1,
    "message_us": 262.5,
    "wire_byte_ns": 1.125,
    "idle_cores": 0.0375,
}

GPU_PROFILE = {
    "name": "NVIDIA H200",
    "kind": "cuda",
    "memory_total_bytes": 150_121_545_728,
    "tflops": {"fp32": 51.2, "bf16": 702.5, "fp16": 698.25},
    "measured_at": T0 + 4.0,
}


def encode_vectors() -> dict[str, dict[str, Any]]:
    records = {
        "joining-minimal": (
            "a peer that just started: no profile, no links, no addresses yet",
            {k: v for k, v in base(state="joining", maddrs=[], seq=0).items() if k != "profile"},
        ),
        "online-cpu": (
            "an online CPU peer with one measured link",
            base(links=[link(PEER_B, rtt_ms=81.5, bw_up_mbps=19.6, bw_down_mbps=20.1)]),
        ),
        "online-gpu-links": (
            "a GPU peer whose free memory is unknown, with links in every status",
            base(
                peer_id=PEER_B,
                name="lab-h200",
                profile=GPU_PROFILE,
                maddrs=["/ip4/198.51.100.20/tcp/4001", "/ip6/2001:db8::20/tcp/4001"],
                links=[
                    link(PEER_A, rtt_ms=0.42, bw_up_mbps=940.0, bw_down_mbps=912.5),
                    link(PEER_C, rtt_ms=150.0, status="timeout"),
                    link(PEER_D, status="unreachable", measured_at=T0 + 25.0),
                ],
            ),
        ),
        "cpu-shared-machine": (
            "a CPU peer on a machine other daemons share: its cores, what its messages cost, its idle load",
            base(profile=SHARED_CPU_PROFILE),
        ),
        "offline": ("a peer that left gracefully", base(state="offline", seq=41, updated_at=T0 + 600.0)),
        "unicode-name": (
            "non-ASCII text is UTF-8 msgpack str",
            base(
                name="Jürgen’s Mac — 東京",
                profile={**base()["profile"], "kind": "mps", "tflops": {"fp32": 3.5, "fp16": 7.0}},
            ),
        ),
    }
    out = {}
    for name, (description, wire) in records.items():
        raw = canonical_pack(wire)
        rec = decode_peer_record(raw)
        assert encode_peer_record(rec) == raw and peer_record_to_wire(rec) == wire, name
        out[f"encode-{name}"] = {
            "type": "encode",
            "description": description,
            "record": wire,
            "msgpack_hex": raw.hex(),
        }
    return out


def decode_vectors() -> dict[str, dict[str, Any]]:
    unknown = base(links=[link(PEER_B, rtt_ms=12.0, jitter_ms=0.5)], future_field={"x": [1, 2, 3]})
    unknown["profile"] = {**unknown["profile"], "numa_nodes": 2}
    unsorted = dict(
        reversed(list(base(started_at=1_767_225_600, seq=7).items()))
    )  # int where a float is expected
    nils = base(links=[link(PEER_B, rtt_ms=None, bw_up_mbps=None, status="busy")])
    nils["profile"] = None
    cases = {
        "unknown-fields": ("unknown keys at any level are ignored within v1", msgpack.packb(unknown)),
        "unsorted-int-time": (
            "keys in any order; an integer where a float is expected",
            msgpack.packb(unsorted),
        ),
        "nil-optionals": ("nil in an optional field means absent", msgpack.packb(nils)),
    }
    out = {}
    for name, (description, raw) in cases.items():
        rec = decode_peer_record(raw)
        canonical = encode_peer_record(rec)
        assert canonical != raw, name
        out[f"decode-{name}"] = {
            "type": "decode",
            "description": description,
            "msgpack_hex": raw.hex(),
            "record": peer_record_to_wire(rec),
            "canonical_hex": canonical.hex(),
        }
    return out


def reject_vectors() -> dict[str, dict[str, Any]]:
    pack = canonical_pack
    good = pack(base())
    too_many = base(links=[link(fake_peer_id(f"n{i}"), rtt_ms=1.0) for i in range(MAX_LINKS + 1)])
    padded = pack({**base(), "padding": "x" * MAX_PEER_RECORD_BYTES})
    cases: dict[str, tuple[str, bytes, ErrorCode]] = {
        "not-msgpack": ("0xc1 is never valid msgpack", b"\xc1", ErrorCode.MALFORMED),
        "truncated": ("the record cut short", good[:-5], ErrorCode.MALFORMED),
        "trailing-bytes": ("a valid record followed by another byte", good + b"\x00", ErrorCode.MALFORMED),
        "not-a-map": ("top level is an array", pack([1, "peer"]), ErrorCode.MALFORMED),
        "ext-type": (
            "msgpack extension types are not allowed",
            pack({**base(), "x": msgspec.msgpack.Ext(5, b"ab")}),
            ErrorCode.MALFORMED,
        ),
        "int-key": ("map keys must be strings", msgpack.packb({**base(), 7: "x"}), ErrorCode.MALFORMED),
        "missing-version": (
            "no 'v'",
            pack({k: v for k, v in base().items() if k != "v"}),
            ErrorCode.MALFORMED,
        ),
        "version-2": ("a version this peer does not speak", pack(base(v=2)), ErrorCode.UNSUPPORTED_VERSION),
        "kind-job": (
            "another message kind under the peer key",
            pack(base(kind="job")),
            ErrorCode.UNKNOWN_KIND,
        ),
        "missing-peer-id": (
            "required field absent",
            pack({k: v for k, v in base().items() if k != "peer_id"}),
            ErrorCode.MALFORMED,
        ),
        "bad-peer-id": (
            "'0', 'O', 'I', 'l' are not base58",
            pack(base(peer_id="Qm0OIl" + PEER_A[6:])),
            ErrorCode.MALFORMED,
        ),
        "unknown-state": ("state outside the enum", pack(base(state="sleeping")), ErrorCode.MALFORMED),
        "negative-seq": ("seq must be a non-negative integer", pack(base(seq=-1)), ErrorCode.MALFORMED),
        "bool-seq": ("booleans are not integers", pack(base(seq=True)), ErrorCode.MALFORMED),
        "string-time": ("timestamps are numbers", pack(base(updated_at="2026-01-01")), ErrorCode.MALFORMED),
        "nan-tflops": (
            "measurements must be finite",
            pack(base(profile={**base()["profile"], "tflops": {"fp32": float("nan")}})),
            ErrorCode.MALFORMED,
        ),
        "zero-message-cost": (
            "measured costs are > 0",
            pack(base(profile={**SHARED_CPU_PROFILE, "message_us": 0.0})),
            ErrorCode.MALFORMED,
        ),
        "unknown-device-kind": (
            "device kind outside the enum",
            pack(base(profile={**base()["profile"], "kind": "tpu"})),
            ErrorCode.MALFORMED,
        ),
        "bad-link-status": (
            "link status outside the enum",
            pack(base(links=[link(PEER_B, status="meh")])),
            ErrorCode.MALFORMED,
        ),
        "duplicate-link": (
            "two measurements for one peer",
            pack(base(links=[link(PEER_B, rtt_ms=1.0), link(PEER_B, rtt_ms=2.0)])),
            ErrorCode.MALFORMED,
        ),
        "started-after-update": (
            "started_at later than updated_at",
            pack(base(started_at=T0 + 60.0)),
            ErrorCode.MALFORMED,
        ),
        "bad-maddr": (
            "multiaddrs start with '/'",
            pack(base(maddrs=["127.0.0.1:4001"])),
            ErrorCode.MALFORMED,
        ),
        "long-name": ("name longer than 128 characters", pack(base(name="n" * 129)), ErrorCode.MALFORMED),
        "too-many-links": (f"more than {MAX_LINKS} links", pack(too_many), ErrorCode.OVERSIZED),
        "oversized": (
            f"larger than {MAX_PEER_RECORD_BYTES} bytes (else well-formed)",
            padded,
            ErrorCode.OVERSIZED,
        ),
    }
    out = {}
    for name, (description, raw, code) in cases.items():
        try:
            decode_peer_record(raw)
        except PeerdError as exc:
            assert exc.code == code, (name, exc)
        else:
            raise AssertionError(f"{name} was accepted")
        out[f"reject-{name}"] = {
            "type": "reject",
            "description": description,
            "msgpack_hex": raw.hex(),
            "error": code.name,
            "error_code": int(code),
        }
    return out


def time_vectors() -> dict[str, dict[str, Any]]:
    updated = T0 + 30.0
    cases: dict[str, tuple[str, dict[str, Any], float, float | None, ErrorCode | None]] = {
        "fresh": ("updated 5 s ago, expires in 55 s", base(), updated + 5, updated + 60, None),
        "within-skew": (
            "5 s ahead of DHT time: inside the 10 s skew allowance",
            base(),
            updated - 5,
            None,
            None,
        ),
        "from-future": (
            "updated one hour ahead of DHT time",
            base(),
            updated - 3600,
            None,
            ErrorCode.FROM_FUTURE,
        ),
        "link-from-future": (
            "a link measured 60 s in the future",
            base(links=[link(PEER_B, measured_at=updated + 60)]),
            updated,
            None,
            ErrorCode.FROM_FUTURE,
        ),
        "ttl-too-long": (
            "asks the DHT to keep it a day",
            base(),
            updated,
            updated + 86_400,
            ErrorCode.FROM_FUTURE,
        ),
        "stale": ("last updated 20 minutes ago", base(), updated + 1200, None, ErrorCode.STALE),
        "expired": ("DHT expiration already passed", base(), updated + 100, updated + 60, ErrorCode.STALE),
    }
    out = {}
    for name, (description, wire, now, expiration, code) in cases.items():
        raw = canonical_pack(wire)
        rec = decode_peer_record(raw)
        try:
            check_record_time(rec, now, expiration_time=expiration)
            got = None
        except PeerdError as exc:
            got = exc.code
        assert got == code, (name, got)
        out[f"time-{name}"] = {
            "type": "time",
            "description": description,
            "msgpack_hex": raw.hex(),
            "now": now,
            "expiration_time": expiration,
            "error": None if code is None else code.name,
        }
    return out


def all_vectors() -> dict[str, dict[str, Any]]:
    return {**encode_vectors(), **decode_vectors(), **reject_vectors(), **time_vectors()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the committed files instead of writing"
    )
    args = parser.parse_args()
    vectors = {f"{name}.json": json.dumps(case, indent=2) + "\n" for name, case in all_vectors().items()}
    if args.check:
        on_disk = {p.name: p.read_text() for p in OUT.glob("*.json")}
        if on_disk != vectors:
            differing = sorted(
                set(on_disk) ^ set(vectors) | {n for n in vectors if on_disk.get(n) != vectors[n]}
            )
            print("out of date: " + ", ".join(differing), file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for stale in set(p.name for p in OUT.glob("*.json")) - set(vectors):
        (OUT / stale).unlink()
    for name, text in vectors.items():
        (OUT / name).write_text(text)
    print(f"wrote {len(vectors)} vectors to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
