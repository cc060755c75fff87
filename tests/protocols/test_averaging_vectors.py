"""The averaging protocol against the byte-exact vectors in protocols/vectors/averaging/ (see protocols/averaging.md).

``python tests/protocols/test_averaging_vectors.py --write`` regenerates the vectors from the
current encoder; the tests then pin them (and check parts of them independently of it:
raw payload bytes, the error-feedback identity, the digests' definition).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from peerd.averaging.codec import GradientCompression, build_codec, decode_share
from peerd.averaging.core import MemberMath
from peerd.averaging.messages import KIND_PART, KIND_SHARE, AvgMessage, Expect, check, parse
from peerd.averaging.partition import FlatLayout, group_digest, share_bounds
from peerd.compress import wire
from peerd.compress.gradient import ErrorFeedbackCompressor
from peerd.errors import ErrorCode, PeerdError
from peerd.swarm.framing import encode_frame, read_frame

VECTORS = Path(__file__).resolve().parents[2] / "protocols" / "vectors" / "averaging"
MEMBERS = [
    "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
    "QmT3nvRZrK2uUsJ4i3nJnvuHkFzh7jQ5tPAVqWi2ZsBK2x",
    "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z",
]
KEY = "job-0f3a/s1"
SHAPES = [[2, 3], [3], [1]]  # 10 elements; shares of a 3-member group: 3, 3, 4


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _files(kind: str) -> list[Path]:
    return [p for p in sorted(VECTORS.glob("*.json")) if _load(p)["type"] == kind]


def _compression(spec: dict | None) -> GradientCompression | None:
    return None if spec is None else GradientCompression(**spec)


def _f32(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _decode_frame(data: bytes):
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader, timeout=1.0)

    return asyncio.run(go())


# ---------------------------------------------------------------- generation


def _digests() -> dict[str, Any]:
    layout = FlatLayout(tuple(tuple(s) for s in SHAPES))
    return {
        "type": "digests",
        "description": "group digest of (key, ordered members) and layout signature of the gradient shapes",
        "key": KEY,
        "members": MEMBERS,
        "group": group_digest(KEY, MEMBERS),
        "shapes": SHAPES,
        "layout": layout.signature(),
    }


def _message_vector(desc: str, msg: AvgMessage, comp: dict | None, values: list[float]) -> dict[str, Any]:
    payload, decoded = build_codec(_compression(comp)).encode(_f32(values), reconstruct=True)
    return {
        "type": "message",
        "description": desc,
        "compression": comp,
        "members": len(MEMBERS),
        "input": values,
        "decoded": (decoded if decoded is not None else _f32(values)).tolist(),
        "header": msg.header(),
        "payload_hex": payload.hex(),
        "frame_hex": encode_frame(msg.header(), payload).hex(),
    }


def generate() -> dict[str, dict[str, Any]]:
    digest = group_digest(KEY, MEMBERS)
    layout = FlatLayout(tuple(tuple(s) for s in SHAPES)).signature()
    q8 = {"bits": 8, "group_size": 4, "scale": "absmax", "rounding": "nearest"}
    q4 = {"bits": 4, "group_size": 2, "scale": "absmax", "rounding": "nearest"}
    part = AvgMessage(KIND_PART, digest, 12, 2, 0, 10, layout)  # rank 2 -> rank 0: share 0 (3 values)
    out = {"digests": _digests()}
    out["part-raw"] = _message_vector(
        "rank 2 sends share 0 (3 values) uncompressed", part, None, [0.5, -1.25, 3.0]
    )
    out["part-q8"] = _message_vector(
        "rank 2 sends share 0 at 8 bits, groups of 4", part, q8, [0.5, -1.25, 3.0]
    )
    share = AvgMessage(KIND_SHARE, digest, 12, 1, 1, 10, layout)  # rank 1 answers with averaged share 1
    out["share-q4"] = _message_vector(
        "rank 1 answers with the averaged share 1 at 4 bits, groups of 2", share, q4, [0.125, -0.375, 0.0625]
    )
    # error feedback: the same input twice under one key; the second frame carries the first's loss
    ef = ErrorFeedbackCompressor(codec=build_codec(_compression(q4)))
    steps = []
    for values in ([0.3, -0.7, 0.11, 0.9, -0.05], [0.3, -0.7, 0.11, 0.9, -0.05]):
        enc = ef.encode("send/0", _f32(values), stage=True)
        ef.commit()
        steps.append(
            {
                "input": values,
                "payload_hex": enc.payload.hex(),
                "decoded": enc.decoded.tolist(),
                "residual": ef.residual("send/0").tolist(),
            }
        )
    out["error-feedback-q4"] = {
        "type": "error_feedback",
        "description": "sender residual over two steps of the same input (4 bits, groups of 2)",
        "compression": q4,
        "steps": steps,
    }
    # the reducer of share 1 in a group of 3: contributions in rank order, mean, then 8-bit frame
    parts = [[1.0, 2.0, 3.0], [0.5, -0.5, 0.25], [-1.0, 0.75, 4.0]]
    enc = MemberMath(1, 3, _compression(q8)).reduce([_f32(p) for p in parts])
    out["reduce-q8"] = {
        "type": "reduce",
        "description": "rank 1 of 3 reduces share 1: ((c0 + c1) + c2) / 3, then 8 bits, groups of 4",
        "compression": q8,
        "members": 3,
        "rank": 1,
        "parts": parts,
        "payload_hex": enc.payload.hex(),
        "decoded": enc.decoded.tolist(),
    }
    out.update(_invalid(part, layout, digest))
    return out


def _invalid(part: AvgMessage, layout: str, digest: str) -> dict[str, dict[str, Any]]:
    raw = build_codec(None)
    ok_payload = raw.encode(_f32([0.5, -1.25, 3.0]))[0]
    nan_payload = bytearray(ok_payload)
    nan_payload[-4:] = struct.pack("<f", float("nan"))
    delta_header = wire.FrameHeader(
        codec=wire.CODEC_DELTA, bits=8, dtype=torch.float32, aux_dtype=torch.bfloat16, shape=(3,),
        ids=(4, 5, 6), symmetric=True, layout="group", group_size=4,
    )  # fmt: skip
    delta = wire.build_frame(delta_header, torch.ones(1), torch.zeros(3, dtype=torch.uint8))
    expect = {"group": digest, "src": 2, "share": 0, "step": 12, "total": 10, "layout": layout}
    h = part.header()
    cases = {
        "bad-step-stale": (h | {"step": 11}, ok_payload, "WRONG_STEP", "a frame for the previous step"),
        "bad-group": (
            h | {"group": "0123456789abcdef"},
            ok_payload,
            "NOT_ALLOWED",
            "sender in another group",
        ),
        "bad-src-impersonation": (h | {"src": 1}, ok_payload, "NOT_ALLOWED", "rank 2's stream claims rank 1"),
        "bad-share-index": (h | {"share": 1}, ok_payload, "MALFORMED", "share 1 sent to rank 0"),
        "bad-total": (h | {"total": 11}, ok_payload, "SHAPE_MISMATCH", "another gradient size"),
        "bad-layout": (
            h | {"layout": "ffffffffffffffff"},
            ok_payload,
            "SHAPE_MISMATCH",
            "another parameter list",
        ),
        "bad-version": (h | {"v": 2}, ok_payload, "UNSUPPORTED_VERSION", "averaging message version 2"),
        "bad-kind": (h | {"kind": "avg.push"}, ok_payload, "UNKNOWN_KIND", "an unknown averaging kind"),
        "bad-step-type": (h | {"step": "12"}, ok_payload, "MALFORMED", "step as a string"),
        "bad-missing-total": (
            {k: v for k, v in h.items() if k != "total"},
            ok_payload,
            "MALFORMED",
            "no total",
        ),
        "bad-payload-truncated": (h, ok_payload[:-2], "TRUNCATED", "payload cut short by 2 bytes"),
        "bad-payload-length": (
            h,
            raw.encode(_f32([1.0, 2.0]))[0],
            "SHAPE_MISMATCH",
            "2 values for a 3-value share",
        ),
        "bad-payload-nan": (h, bytes(nan_payload), "NON_FINITE", "a NaN gradient"),
        "bad-payload-fp16": (
            h,
            build_codec(None).encode(_f32([1, 2, 3]).half())[0],
            "DTYPE_MISMATCH",
            "fp16 share",
        ),
        "bad-payload-delta": (h, delta, "UNKNOWN_CODEC", "an AC-SGD delta frame"),
        "bad-payload-magic": (h, b"XX" + ok_payload[2:], "MALFORMED", "not a compressed-tensor frame"),
    }
    return {
        name: {
            "type": "invalid",
            "description": desc,
            "members": len(MEMBERS),
            "expect_kind": KIND_PART,
            "expect": expect,
            "frame_hex": encode_frame(header, payload).hex(),
            "error": code,
        }
        for name, (header, payload, code, desc) in cases.items()
    }


# ---------------------------------------------------------------- tests


def test_vector_set_is_complete():
    names = {p.stem for p in VECTORS.glob("*.json")}
    assert {"digests", "part-raw", "part-q8", "share-q4", "error-feedback-q4", "reduce-q8"} <= names
    codes = {_load(p)["error"] for p in _files("invalid")}
    assert {"WRONG_STEP", "NOT_ALLOWED", "MALFORMED", "SHAPE_MISMATCH", "TRUNCATED", "NON_FINITE"} <= codes


def test_digests_follow_their_definition():
    case = _load(VECTORS / "digests.json")
    text = "\x00".join([case["key"], *case["members"]])
    assert case["group"] == hashlib.sha256(f"peerd-avg-group-v1|{text}".encode()).hexdigest()[:16]
    assert case["group"] == group_digest(case["key"], case["members"])
    shapes = ";".join(",".join(str(d) for d in s) for s in case["shapes"])
    assert case["layout"] == hashlib.sha256(f"peerd-avg-layout-v1|{shapes}".encode()).hexdigest()[:16]
    assert case["layout"] == FlatLayout(tuple(tuple(s) for s in case["shapes"])).signature()


@pytest.mark.parametrize("path", _files("message"), ids=lambda p: p.stem)
def test_message_vectors_encode_and_decode_byte_exact(path: Path):
    case = _load(path)
    frame, payload = bytes.fromhex(case["frame_hex"]), bytes.fromhex(case["payload_hex"])
    codec = build_codec(_compression(case["compression"]))
    assert codec.encode(_f32(case["input"]))[0] == payload
    assert encode_frame(case["header"], payload) == frame
    header, got_payload, wire_bytes = _decode_frame(frame)
    assert wire_bytes == len(frame) and bytes(got_payload) == payload
    msg = parse(header, header["kind"])
    assert msg.header() == case["header"]
    assert encode_frame(msg.header(), payload) == frame  # the typed header, byte-exact
    start, end = share_bounds(msg.total, case["members"])[msg.share]
    decoded = decode_share(got_payload, end - start)
    assert decoded.tolist() == case["decoded"]
    if case["compression"] is None:  # raw: the last 4n bytes are the little-endian float32 values
        n = len(case["input"])
        assert list(struct.unpack(f"<{n}f", payload[-4 * n :])) == case["input"]


def test_error_feedback_vector():
    case = _load(VECTORS / "error-feedback-q4.json")
    ef = ErrorFeedbackCompressor(codec=build_codec(_compression(case["compression"])))
    previous = torch.zeros(len(case["steps"][0]["input"]))
    for step in case["steps"]:
        x = _f32(step["input"])
        enc = ef.encode("send/0", x, stage=True)
        ef.commit()
        assert enc.payload.hex() == step["payload_hex"]
        assert decode_share(enc.payload, x.numel()).tolist() == step["decoded"]
        assert ef.residual("send/0").tolist() == step["residual"]
        # the residual is exactly what this frame failed to carry
        torch.testing.assert_close(
            _f32(step["decoded"]) + _f32(step["residual"]), x + previous, rtol=0, atol=1e-7
        )
        previous = _f32(step["residual"])
    assert case["steps"][0]["payload_hex"] != case["steps"][1]["payload_hex"]


def test_reduce_vector():
    case = _load(VECTORS / "reduce-q8.json")
    math = MemberMath(case["rank"], case["members"], _compression(case["compression"]))
    enc = math.reduce([_f32(p) for p in case["parts"]])
    assert enc.payload.hex() == case["payload_hex"]
    assert enc.decoded.tolist() == case["decoded"]
    mean = (_f32(case["parts"][0]) + _f32(case["parts"][1]) + _f32(case["parts"][2])) / 3
    assert float((enc.decoded - mean).abs().max()) <= float(mean.abs().max()) / 2**8 * 1.01


@pytest.mark.parametrize("path", _files("invalid"), ids=lambda p: p.stem)
def test_invalid_vectors_are_rejected_with_their_code(path: Path):
    case = _load(path)
    header, payload, _ = _decode_frame(bytes.fromhex(case["frame_hex"]))
    with pytest.raises(PeerdError) as info:
        msg = parse(header, case["expect_kind"])
        check(msg, Expect(**case["expect"]))
        start, end = share_bounds(msg.total, case["members"])[msg.share]
        decode_share(payload, end - start)
    assert info.value.code == ErrorCode[case["error"]]


if __name__ == "__main__" and "--write" in sys.argv:
    VECTORS.mkdir(parents=True, exist_ok=True)
    for name, case in generate().items():
        (VECTORS / f"{name}.json").write_text(json.dumps(case, indent=2) + "\n")
    print(f"wrote {len(list(VECTORS.glob('*.json')))} vectors to {VECTORS}")
