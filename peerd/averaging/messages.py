"""Averaging wire messages (protocols/averaging.md): frame headers, tolerant parsing, checks against the step.

Two kinds ride on the transport's frames, both with a compressed-tensor frame as payload:

- ``avg.part``  — member ``src`` sends its contribution to share ``share`` (reduce-scatter);
- ``avg.share`` — the reducer of ``share`` answers with the averaged share (all-gather).

Unknown header fields are ignored (tolerant within a version); wrong types or missing
fields are MALFORMED. ``Expect`` holds what the receiver knows; ``check`` compares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from peerd.errors import ErrorCode, ProtocolError

VERSION = 1
KIND_PART = "avg.part"
KIND_SHARE = "avg.share"
KINDS = (KIND_PART, KIND_SHARE)


@dataclass(frozen=True)
class AvgMessage:
    kind: str
    group: str
    """Digest of (averaging key, ordered members): partition.group_digest."""
    step: int
    """Training step the gradients belong to."""
    src: int
    """Rank of the sender (for ``avg.share``: the reducer, equal to ``share``)."""
    share: int
    """Which share of the flat vector the payload holds."""
    total: int
    """Elements of the whole flat gradient vector (fixes every share's size)."""
    layout: str
    """partition.FlatLayout.signature() of the sender's gradient list."""

    def header(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "v": VERSION,
            "group": self.group,
            "step": self.step,
            "src": self.src,
            "share": self.share,
            "total": self.total,
            "layout": self.layout,
        }


def _field(header: dict[str, Any], name: str, kind: type) -> Any:
    value = header.get(name)
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ProtocolError(
            f"averaging header field {name!r} must be an int, got {value!r}", code=ErrorCode.MALFORMED
        )
    if kind is str and not isinstance(value, str):
        raise ProtocolError(
            f"averaging header field {name!r} must be a str, got {value!r}", code=ErrorCode.MALFORMED
        )
    return value


def parse(header: dict[str, Any], expected_kind: str) -> AvgMessage:
    """Typed message from a frame header; ProtocolError with the code protocols/averaging.md names."""
    kind = header.get("kind")
    if kind not in KINDS:
        raise ProtocolError(f"unknown averaging message kind {kind!r}", code=ErrorCode.UNKNOWN_KIND)
    version = _field(header, "v", int)
    if version != VERSION:
        raise ProtocolError(
            f"averaging message version {version} (this peer speaks {VERSION})",
            code=ErrorCode.UNSUPPORTED_VERSION,
        )
    if kind != expected_kind:
        raise ProtocolError(f"expected {expected_kind}, got {kind}", code=ErrorCode.MALFORMED)
    msg = AvgMessage(
        kind=kind,
        group=_field(header, "group", str),
        step=_field(header, "step", int),
        src=_field(header, "src", int),
        share=_field(header, "share", int),
        total=_field(header, "total", int),
        layout=_field(header, "layout", str),
    )
    if min(msg.step, msg.src, msg.share, msg.total) < 0:
        raise ProtocolError("averaging header fields must be non-negative", code=ErrorCode.MALFORMED)
    if kind == KIND_SHARE and msg.src != msg.share:
        raise ProtocolError(f"share {msg.share} answered by rank {msg.src}", code=ErrorCode.MALFORMED)
    return msg


@dataclass(frozen=True)
class Expect:
    """What the receiver knows; ``None`` fields are not checked."""

    group: str
    src: int | None = None
    share: int | None = None
    step: int | None = None
    total: int | None = None
    layout: str | None = None


def check(msg: AvgMessage, expect: Expect) -> None:
    """Raise the ProtocolError for the first field that differs from ``expect``."""
    if msg.group != expect.group:
        raise ProtocolError(
            f"sender averages in group {msg.group}, this member in {expect.group}", code=ErrorCode.NOT_ALLOWED
        )
    if expect.src is not None and msg.src != expect.src:
        raise ProtocolError(f"rank {expect.src} claims to be rank {msg.src}", code=ErrorCode.NOT_ALLOWED)
    if expect.share is not None and msg.share != expect.share:
        raise ProtocolError(f"share {msg.share} where share {expect.share} was due", code=ErrorCode.MALFORMED)
    if expect.step is not None and msg.step != expect.step:
        raise ProtocolError(
            f"frame for step {msg.step}, expected step {expect.step}", code=ErrorCode.WRONG_STEP
        )
    if expect.total is not None and msg.total != expect.total:
        raise ProtocolError(
            f"gradient vector of {msg.total} elements, expected {expect.total}", code=ErrorCode.SHAPE_MISMATCH
        )
    if expect.layout is not None and msg.layout != expect.layout:
        raise ProtocolError(
            f"gradient layout {msg.layout} differs from this member's {expect.layout}",
            code=ErrorCode.SHAPE_MISMATCH,
        )
