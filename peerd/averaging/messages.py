"""Averaging wire messages (protocols/averaging.md): the header schema and checks against the step.

Two kinds ride on the transport's frames, both with a compressed-tensor frame as payload:

- ``avg.part``  — member ``src`` sends its contribution to share ``share`` (reduce-scatter);
- ``avg.share`` — the reducer of ``share`` answers with the averaged share (all-gather).

A third, ``avg.hello``, opens every stream (no payload): it names the group and the
allocation epoch the sender averages in, so a member of a superseded allocation is refused
(STALE; FROM_FUTURE for a newer one) before any gradient bytes are read.

The header is declared once (``AvgMessage``) and read by ``peerd.wire``: unknown fields
are ignored (tolerant within a version); wrong types or missing fields are MALFORMED.
``Expect`` holds what the receiver knows; ``check`` compares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from peerd.errors import ErrorCode, ProtocolError
from peerd.swarm.framing import DEFAULT_LIMITS
from peerd.wire import Schema, WireStruct, to_builtin
from peerd.wire.types import Count, Name

VERSION = 1
KIND_PART = "avg.part"
KIND_SHARE = "avg.share"
KIND_HELLO = "avg.hello"
KINDS = (KIND_PART, KIND_SHARE)


class AvgMessage(WireStruct):
    kind: str
    group: Name
    """Digest of (averaging key, ordered members): partition.group_digest."""
    step: Count
    """Training step the gradients belong to."""
    src: Count
    """Rank of the sender (for ``avg.share``: the reducer, equal to ``share``)."""
    share: Count
    """Which share of the flat vector the payload holds."""
    total: Count
    """Elements of the whole flat gradient vector (fixes every share's size)."""
    layout: Name
    """partition.FlatLayout.signature() of the sender's gradient list."""
    version: int = msgspec.field(default=VERSION, name="v")
    overflow: bool | None = None
    """``avg.part``: the sender's fp16 gradients overflowed (its contribution is zeros);
    ``avg.share``: some contribution to this share overflowed. Absent: neither."""

    def header(self) -> dict[str, Any]:
        return to_builtin(self)


class AvgHello(WireStruct):
    """The first frame of every averaging stream, from the member that opened it."""

    kind: str
    group: Name
    """The sender's group digest (as in AvgMessage)."""
    epoch: Count
    """The allocation epoch the sender averages in."""
    version: int = msgspec.field(default=VERSION, name="v")

    def header(self) -> dict[str, Any]:
        return to_builtin(self)


def hello(group: str, epoch: int) -> AvgHello:
    return AvgHello(KIND_HELLO, group, epoch)


_HELLO = Schema(AvgHello, f"{KIND_HELLO} header", DEFAULT_LIMITS.max_header, version=VERSION, kind=KIND_HELLO)


def parse_hello(header: dict[str, Any], group: str, epoch: int) -> AvgHello:
    """The stream's opening hello, checked: NOT_ALLOWED for another group, STALE/FROM_FUTURE for another epoch."""
    if header.get("kind") != KIND_HELLO:
        raise ProtocolError(
            f"an averaging stream must open with {KIND_HELLO}, got {header.get('kind')!r}",
            code=ErrorCode.NOT_ALLOWED,
        )
    msg = _HELLO.check(header)
    if msg.group != group:
        raise ProtocolError(
            f"sender averages in group {msg.group}, this member in {group}", code=ErrorCode.NOT_ALLOWED
        )
    if msg.epoch < epoch:
        raise ProtocolError(
            f"averaging stream of epoch {msg.epoch}: this member runs epoch {epoch}", code=ErrorCode.STALE
        )
    if msg.epoch > epoch:
        raise ProtocolError(
            f"averaging stream of epoch {msg.epoch}: this member still runs epoch {epoch}",
            code=ErrorCode.FROM_FUTURE,
        )
    return msg


def _share_rules(msg: AvgMessage) -> None:
    if msg.src != msg.share:
        raise ProtocolError(f"share {msg.share} answered by rank {msg.src}", code=ErrorCode.MALFORMED)


_SCHEMAS = {
    k: Schema(AvgMessage, f"{k} header", DEFAULT_LIMITS.max_header, version=VERSION, kind=k, rules=rules)
    for k, rules in ((KIND_PART, None), (KIND_SHARE, _share_rules))
}


def parse(header: dict[str, Any], expected_kind: str) -> AvgMessage:
    """Typed message from a frame header; ProtocolError with the code protocols/averaging.md names."""
    schema = _SCHEMAS.get(header.get("kind", ""))
    if schema is None:
        raise ProtocolError(
            f"unknown averaging message kind {header.get('kind')!r}", code=ErrorCode.UNKNOWN_KIND
        )
    msg = schema.check(header)
    if msg.kind != expected_kind:
        raise ProtocolError(f"expected {expected_kind}, got {msg.kind}", code=ErrorCode.MALFORMED)
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
