"""Consensus messages against the byte-exact vectors in protocols/vectors/consensus/.

Each valid vector is checked three ways: the tests' independent canonical packer
(canonical_msgpack.py, written from the spec's encoding rules) must produce its bytes from
its ``wire`` form; peerd's decoder must accept them and peerd's encoder must give them back;
its hashes must match sha256 computed here from the spec's definitions. Invalid vectors must be
refused with their error code. Regenerate (only when the format changes on purpose):
``python tests/protocols/test_consensus_vectors.py --write``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from peerd.errors import ErrorCode, ProtocolError
from peerd.sched.consensus.messages import decode, encode

VECTORS = Path(__file__).resolve().parents[2] / "protocols" / "vectors" / "consensus"
FILES = sorted(VECTORS.glob("*.json"))


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


# --- the independent canonical msgpack writer (tests/protocols/canonical_msgpack.py) --------

_spec = importlib.util.spec_from_file_location(
    "canonical_msgpack", Path(__file__).with_name("canonical_msgpack.py")
)
canonical_msgpack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(canonical_msgpack)  # type: ignore[union-attr]
canonical = canonical_msgpack.canonical  # JSON wire form -> bytes; ``{"bin": hex}`` is a bin value


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def allocation_hash(alloc: dict) -> str:
    """The scheduler's canonical allocation digest: sha256 of sorted-key, compact JSON."""
    return sha(json.dumps(alloc, sort_keys=True, separators=(",", ":")).encode())


def roster_digest(refs: list[list[str]]) -> str:
    return sha(canonical([[peer, {"bin": h}] for peer, h in sorted(refs)]))


# --- the checks -------------------------------------------------------------------------------

VALID = [f for f in FILES if _load(f)["type"] == "message"]
INVALID = [f for f in FILES if _load(f)["type"] == "invalid"]


def test_vector_set_is_complete() -> None:
    kinds = {_load(f)["wire"]["kind"] for f in VALID}
    assert kinds == {"roster", "candidate", "vote", "commit"}
    codes = {_load(f)["error"] for f in INVALID}
    assert {"MALFORMED", "UNSUPPORTED_VERSION", "UNKNOWN_KIND", "OVERSIZED"} <= codes


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.stem)
def test_valid_vector(path: Path) -> None:
    case = _load(path)
    data = bytes.fromhex(case["bytes_hex"])
    if not case.get("decode_only"):
        assert canonical(case["wire"]) == data  # the spec's canonical form, written independently
    msg = decode(data)
    assert case["wire"]["kind"] == msg.KIND
    canonical_bytes = bytes.fromhex(case.get("canonical_hex", case["bytes_hex"]))
    assert encode(msg) == canonical_bytes
    hashes = case.get("hashes", {})
    if "entry_hash" in hashes:
        assert sha(canonical_bytes) == hashes["entry_hash"] == msg.hash.hex()
    if "allocation_hash" in hashes:
        cand = msg.candidate if msg.KIND == "commit" else msg
        assert (
            allocation_hash(case["allocation_json"]) == hashes["allocation_hash"] == cand.allocation.digest()
        )
        digest = bytes.fromhex(cand.roster_digest.hex())
        expected_id = sha(canonical([{"bin": digest.hex()}, {"bin": hashes["allocation_hash"]}]))
        assert expected_id == hashes["candidate_id"] == cand.id.hex()
    if "roster_digest" in hashes:
        assert roster_digest(case["roster_refs"]) == hashes["roster_digest"]


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_vector_is_refused_with_its_code(path: Path) -> None:
    case = _load(path)
    with pytest.raises(ProtocolError) as err:
        decode(bytes.fromhex(case["bytes_hex"]))
    assert err.value.code == ErrorCode[case["error"]]
    if "field" in case:
        assert case["field"] in str(err.value)


# --- regeneration ---------------------------------------------------------------------------


def _write_vectors() -> None:  # pragma: no cover - run by hand
    from peerd.sched.allocation import Allocation
    from peerd.sched.consensus.messages import (
        Candidate,
        CommitRecord,
        Roster,
        RosterDevice,
        RosterEntry,
        RosterLink,
        Vote,
    )

    def wire(data: bytes) -> Any:
        import msgpack

        def conv(x: Any) -> Any:
            if isinstance(x, bytes):
                return {"bin": x.hex()}
            if isinstance(x, dict):
                return {k: conv(v) for k, v in x.items()}
            if isinstance(x, list):
                return [conv(v) for v in x]
            return x

        return conv(msgpack.unpackb(data, raw=False))

    out: dict[str, dict] = {}
    job, t = "job-7f3a", 1700000000.25
    peers = ["QmAlice", "QmBob", "QmCarol", "QmDave"]
    entries = [
        RosterEntry(
            job,
            0,
            p,
            t + i,
            RosterDevice(25.5 + 10 * i, (16 + 8 * i) << 30, ["eu", "us"][i % 2]),
            tuple(
                RosterLink(q, 0.004 + 0.03 * (i != j) * (i % 2 != j % 2), 1e9 if i % 2 == j % 2 else 1.25e8)
                for j, q in enumerate(peers)
                if q != p
            ),
        )
        for i, p in enumerate(peers)
    ]
    roster = Roster.of(0, entries)
    e0 = encode(entries[0])
    out["roster-entry"] = {
        "type": "message",
        "description": "QmAlice's roster entry for epoch 0 (3 links)",
        "wire": wire(e0),
        "bytes_hex": e0.hex(),
        "hashes": {"entry_hash": sha(e0)},
    }
    empty = RosterEntry(job, 3, "QmEve", t, RosterDevice(1.0, 0), ())
    out["roster-entry-minimal"] = {
        "type": "message",
        "description": "no links, empty region, epoch 3",
        "wire": wire(encode(empty)),
        "bytes_hex": encode(empty).hex(),
        "hashes": {"entry_hash": sha(encode(empty))},
    }
    # tolerant decoding: unknown keys (top level and nested) are ignored and not hashed
    w = wire(e0)
    w["zz_future"] = [1, 2]
    w["profile"]["gpu_name"] = "H100"
    out["roster-entry-unknown-keys"] = {
        "type": "message",
        "decode_only": True,
        "description": "extra keys from a newer v1 peer: ignored, hash unchanged",
        "wire": w,
        "bytes_hex": canonical(w).hex(),
        "canonical_hex": e0.hex(),
        "hashes": {"entry_hash": sha(e0)},
    }
    alloc = Allocation.from_plain([["QmBob", "QmAlice"], ["QmDave", "QmCarol"]], layers=[10, 14])
    cand = Candidate(job, 0, "QmCarol", t + 30.5, alloc, 3.4375, roster.peers, roster.digest)
    c = encode(cand)
    out["candidate"] = {
        "type": "message",
        "description": "2 stages x 2 replicas, uneven layers, on the 4-peer roster",
        "wire": wire(c),
        "bytes_hex": c.hex(),
        "allocation_json": alloc.to_dict(),
        "roster_refs": [[p, h.hex()] for p, h in roster.refs],
        "hashes": {
            "allocation_hash": alloc.digest(),
            "candidate_id": cand.id.hex(),
            "roster_digest": roster.digest.hex(),
        },
    }
    sub = roster.subset(["QmAlice", "QmBob", "QmCarol"])
    spare = Allocation.from_plain([["QmAlice"], ["QmBob"]], spares=["QmCarol"])
    cand2 = Candidate(job, 0, "QmAlice", t + 31, spare, 12.0, sub.peers, sub.digest)
    c2 = encode(cand2)
    out["candidate-spare-subroster"] = {
        "type": "message",
        "description": "one spare, even layers (nil), 3-peer sub-roster",
        "wire": wire(c2),
        "bytes_hex": c2.hex(),
        "allocation_json": spare.to_dict(),
        "roster_refs": [[p, h.hex()] for p, h in sub.refs],
        "hashes": {
            "allocation_hash": spare.digest(),
            "candidate_id": cand2.id.hex(),
            "roster_digest": sub.digest.hex(),
        },
    }
    votes = [Vote(job, 0, 0, p, t + 60 + i, cand.id, 3.4375, roster.digest) for i, p in enumerate(peers[:3])]
    v = encode(votes[0])
    out["vote"] = {
        "type": "message",
        "description": "QmAlice's round-0 vote for the candidate",
        "wire": wire(v),
        "bytes_hex": v.hex(),
    }
    rec = CommitRecord(job, 0, 0, "QmBob", t + 63, cand, roster.refs, tuple(votes))
    r = encode(rec)
    out["commit"] = {
        "type": "message",
        "description": "QmBob's proof: the candidate, its roster refs, 3 of 4 votes",
        "wire": wire(r),
        "bytes_hex": r.hex(),
        "allocation_json": alloc.to_dict(),
        "roster_refs": [[p, h.hex()] for p, h in roster.refs],
        "hashes": {
            "allocation_hash": alloc.digest(),
            "candidate_id": cand.id.hex(),
            "roster_digest": roster.digest.hex(),
        },
    }

    def bad(name: str, description: str, w: Any, error: str, field: str | None = None) -> None:
        case = {
            "type": "invalid",
            "description": description,
            "bytes_hex": (w if isinstance(w, bytes) else canonical(w)).hex(),
            "error": error,
        }
        if field:
            case["field"] = field
        out[name] = case

    def edit(data: bytes, **changes: Any) -> Any:
        w = wire(data)
        for k, val in changes.items():
            if val is ...:
                del w[k]
            else:
                w[k] = val
        return w

    bad("bad-version", "version 2", edit(v, version=2), "UNSUPPORTED_VERSION")
    bad("bad-kind", "kind 'ballot'", edit(v, kind="ballot"), "UNKNOWN_KIND")
    bad("bad-msgpack-truncated", "vote cut short", v[:-5], "MALFORMED")
    bad("bad-not-a-map", "top level is an array", [1, "vote"], "MALFORMED")
    bad("bad-missing-voter", "vote without voter", edit(v, voter=...), "MALFORMED", "voter")
    bad("bad-epoch-type", "epoch as a string", edit(v, epoch="0"), "MALFORMED", "epoch")
    bad("bad-round", "round 2 does not exist", edit(v, round=2), "MALFORMED", "round")
    bad(
        "bad-hash-length",
        "candidate id of 31 bytes",
        edit(v, candidate={"bin": "00" * 31}),
        "MALFORMED",
        "candidate",
    )
    bad("bad-cost-negative", "negative claimed cost", edit(c, cost=-1.0), "MALFORMED", "cost")
    wa = wire(c)
    wa["allocation"]["stages"][1][0] = "QmBob"
    bad("bad-allocation-duplicate", "one peer in two tasklets", wa, "MALFORMED", "allocation")
    wm = wire(c)
    wm["members"] = ["QmAlice", "QmBob", "QmCarol"]
    bad("bad-allocation-off-members", "allocation uses a peer outside members", wm, "MALFORMED", "allocation")
    wu = wire(c)
    wu["members"] = list(reversed(wu["members"]))
    bad("bad-members-unsorted", "members not sorted", wu, "MALFORMED", "members")
    wl = wire(e0)
    wl["links"] = list(reversed(wl["links"]))
    bad("bad-links-unsorted", "links not sorted by peer", wl, "MALFORMED", "links")
    wn = wire(r)
    wn["candidate"] = wn["votes"][0]
    bad("bad-commit-nested-kind", "a vote where the candidate belongs", wn, "MALFORMED", "candidate")
    big = edit(v, voter="Qm" + "x" * 5000)
    bad("bad-oversized-vote", "a vote over its 4 KiB limit", big, "OVERSIZED")
    for name, case in out.items():
        (VECTORS / f"{name}.json").write_text(json.dumps(case, indent=2) + "\n")


if __name__ == "__main__" and "--write" in sys.argv:  # pragma: no cover
    VECTORS.mkdir(parents=True, exist_ok=True)
    _write_vectors()
