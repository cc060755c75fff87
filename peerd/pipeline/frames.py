"""Activation and gradient messages between pipeline stages: header schema, chunking, validation (protocols/pipeline-frames.md).

A *message* is one micro-batch's tensor crossing one stage boundary: activations forward
(``pp.act``) or the gradient w.r.t. them backward (``pp.grad``); or, once per step when
gradient clipping is on, one float64 of the replica's gradient norm exchange
(``peerd.pipeline.optim``): a partial sum of squares backward (``pp.norm.part``) and the
total forward (``pp.norm.total``), same header, no example ids, shape ``[1]``; or, at the steps a job
evaluates its validation split, the activations of a held-out micro-batch (``pp.val``: forward
only, always raw float32, never through AC-SGD's buffers). Its payload is the codec's
wire bytes (peerd.compress's format) or, for codec ``none``, the raw little-endian tensor.
A message travels as one or more transport frames (*parts*), each carrying the full header
plus ``part``/``parts``/``off`` so the receiver can check the metadata before the bulk arrives
and never needs to buffer more than one message. Control frames (``pp.ack``/``pp.nack``/
``pp.abort``) flow the other way on the same stream. Every stream opens with ``pp.hello``,
which binds it to the sender's allocation epoch: a receiver takes frames only from the
committed neighbours of its own epoch (``check_epoch``). Everything here is pure: the async
shells are in ``peerd.pipeline.streams``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import torch
from msgspec import Meta

from peerd.errors import ErrorCode, ProtocolError
from peerd.swarm.framing import DEFAULT_LIMITS
from peerd.wire import Schema, WireStruct, convert, to_builtin
from peerd.wire.types import Count, Name

VERSION = 1
KIND_ACT = "pp.act"
KIND_GRAD = "pp.grad"
KIND_NORM_PART = "pp.norm.part"  # sum of squared gradient norms of stages b+1.., travels upstream
KIND_NORM_TOTAL = "pp.norm.total"  # the replica's total sum of squares, travels downstream
KIND_VAL = "pp.val"  # activations of a held-out micro-batch (evaluation: forward only, raw fp32)
KIND_ACK = "pp.ack"
KIND_NACK = "pp.nack"
KIND_ABORT = "pp.abort"
KIND_HELLO = "pp.hello"  # first frame of every stream, sender -> receiver: the allocation epoch
DATA_KINDS = (KIND_ACT, KIND_GRAD, KIND_NORM_PART, KIND_NORM_TOTAL, KIND_VAL)
FORWARD_KINDS = (KIND_ACT, KIND_NORM_TOTAL, KIND_VAL)  # sent by the upstream neighbour
BACKWARD_KINDS = (KIND_GRAD, KIND_NORM_PART)  # sent by the downstream neighbour
NORM_SHAPE = (1,)
NORM_DTYPE = "float64"
CONTROL_KINDS = (KIND_ACK, KIND_NACK, KIND_ABORT, KIND_HELLO)

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,  # norm frames only: a sum over stages keeps its precision
}

MAX_NDIM = 8
MAX_IDS = 1 << 16  # examples per micro-batch
MAX_PARTS = 1 << 16
MAX_MESSAGE_BYTES = 1 << 32  # 4 GiB: far above any stage boundary of the presets
MAX_TEXT = 1000  # characters of an error message on the wire
RAW_CODEC = "none"  # payload = the tensor's little-endian bytes
COMPRESSED_SLACK = 4096  # bytes of codec headers and scales a compressed payload may add

if sys.byteorder != "little":  # raw payloads are little-endian and reinterpreted in place
    raise ImportError("peerd.pipeline.frames assumes a little-endian host")


def _bad(message: str, code: ErrorCode = ErrorCode.MALFORMED) -> ProtocolError:
    return ProtocolError(message, code=code)


# ---------------------------------------------------------------- the schema


_Dim = Annotated[int, Meta(ge=0, lt=1 << 32)]
_Text = Annotated[str, Meta(max_length=MAX_TEXT)]


class _Envelope(WireStruct, kw_only=True):
    version: int = msgspec.field(default=VERSION, name="v")


class TensorMessage(_Envelope):
    """Metadata of one activation or gradient message (identical in every part of it)."""

    kind: str  # one of DATA_KINDS
    job: Name
    step: Count
    mb: Annotated[int, Meta(ge=0, lt=MAX_IDS)]  # micro-batch index within the step
    boundary: Annotated[int, Meta(ge=0, lt=1 << 16)] = msgspec.field(name="b")  # stages b | b + 1
    ids: Annotated[tuple[Count, ...], Meta(max_length=MAX_IDS)]  # example ids, row order
    codec: Name
    shape: Annotated[
        tuple[_Dim, ...], Meta(max_length=MAX_NDIM)
    ]  # the decoded tensor's, (B, T, C); norm: (1,)
    dtype: Name  # the decoded tensor's dtype name
    seq: Count  # sender's message sequence number on this stream (ordering, acks, resends)
    nbytes: Count  # payload bytes of the whole message

    @property
    def key(self) -> tuple[str, int, int]:
        return self.kind, self.step, self.mb


class _Span(WireStruct):
    """Where a part sits in its message: the header fields besides the message's metadata."""

    index: Annotated[int, Meta(ge=0, lt=MAX_PARTS)] = msgspec.field(name="part")
    count: Annotated[int, Meta(ge=1, le=MAX_PARTS)] = msgspec.field(name="parts")
    offset: Count = msgspec.field(name="off")


@dataclass(frozen=True)
class Part:
    """One transport frame of a message: payload bytes ``[off, off + len)`` of ``parts`` frames."""

    message: TensorMessage
    index: int
    count: int
    offset: int


class _Control(_Envelope, tag_field="kind"):
    """Control frames (empty payload) flow against the data on the same stream."""


class Ack(_Control, tag=KIND_ACK):
    seq: Count  # every message up to and including ``seq`` was accepted


class Nack(_Control, tag=KIND_NACK):
    # this message was rejected; resend it and everything after it (-1: its seq was unreadable)
    seq: Annotated[int, Meta(ge=-1)]
    code: ErrorCode
    message: _Text = ""


class Abort(_Control, tag=KIND_ABORT):
    step: Count
    code: ErrorCode
    message: _Text = ""


class Hello(_Control, tag=KIND_HELLO):
    epoch: Count  # the allocation epoch the sender runs; the protocol name already binds job and stage


Control = Ack | Nack | Abort | Hello


def _message_rules(msg: TensorMessage) -> None:
    if msg.dtype not in DTYPES:
        raise _bad(
            f"{msg.kind} frame: dtype {msg.dtype!r} is not one of {sorted(DTYPES)}", ErrorCode.DTYPE_MISMATCH
        )
    if len(set(msg.ids)) != len(msg.ids):
        raise _bad(f"{msg.kind} frame: ids: duplicate example ids")


_HEADER_BYTES = DEFAULT_LIMITS.max_header
_DATA = {
    k: Schema(TensorMessage, f"{k} frame", _HEADER_BYTES, version=VERSION, kind=k, rules=_message_rules)
    for k in DATA_KINDS
}
_CONTROL: dict[str, Schema[Any]] = {
    k: Schema(cls, f"{k} frame", _HEADER_BYTES, version=VERSION, kind=k)
    for k, cls in zip(CONTROL_KINDS, (Ack, Nack, Abort, Hello), strict=True)
}


# ---------------------------------------------------------------- encoding


def part_header(msg: TensorMessage, index: int = 0, count: int = 1, offset: int = 0) -> dict[str, Any]:
    """The transport header of part ``index`` of ``count`` of ``msg`` (its payload starts at ``offset``)."""
    return to_builtin(msg) | to_builtin(_Span(index, count, offset))


def control_header(ctl: Control) -> dict[str, Any]:
    """The transport header of a control frame; a too long error text is cut to MAX_TEXT characters."""
    if isinstance(ctl, Nack | Abort) and len(ctl.message) > MAX_TEXT:
        ctl = msgspec.structs.replace(ctl, message=ctl.message[:MAX_TEXT])
    return to_builtin(ctl)


def part_spans(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each part when a ``nbytes`` payload is cut into ``chunk``-byte parts."""
    assert chunk > 0
    if nbytes == 0:
        return [(0, 0)]
    return [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]


def raw_payload(tensor: torch.Tensor) -> memoryview:
    """Codec ``none``: the tensor's bytes, row-major little-endian, without a copy when contiguous on CPU."""
    t = tensor.detach().contiguous().cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return t.view(torch.uint8).numpy().data.cast("B")


def raw_tensor(msg: TensorMessage, payload: bytearray | memoryview) -> torch.Tensor:
    """Codec ``none``: view ``payload`` as the announced tensor (zero-copy; the caller hands over the buffer)."""
    dtype = DTYPES[msg.dtype]
    numel = math.prod(msg.shape)
    need = numel * dtype.itemsize
    if len(payload) != need:
        raise _bad(
            f"raw payload of {len(payload)} B cannot be a {msg.dtype} tensor of shape {list(msg.shape)} ({need} B)",
            ErrorCode.SHAPE_MISMATCH,
        )
    if numel == 0:
        return torch.empty(msg.shape, dtype=dtype)
    return torch.frombuffer(payload, dtype=dtype).view(msg.shape)


# ---------------------------------------------------------------- decoding: schema


def parse_part(header: Mapping[str, Any]) -> Part:
    """Check a data frame's header against the schema (types, ranges); unknown extra keys are ignored."""
    schema = _DATA.get(header.get("kind", ""))
    if schema is None:
        raise _bad(f"not a pipeline data frame: kind {header.get('kind')!r}", ErrorCode.UNKNOWN_KIND)
    try:
        msg, span = schema.check(header), convert(header, _Span, what=schema.what)
    except ProtocolError as exc:
        if exc.code != ErrorCode.OVERSIZED:
            raise
        raise _bad(exc.args[0]) from None  # protocols/pipeline-frames.md: a list over its limit is MALFORMED
    if span.index >= span.count or span.offset > msg.nbytes:
        raise _bad(f"{schema.what}: part {span.index} of {span.count} at byte {span.offset} of {msg.nbytes}")
    return Part(msg, span.index, span.count, span.offset)


def parse_control(header: Mapping[str, Any]) -> Control:
    """Decode a ``pp.ack`` / ``pp.nack`` / ``pp.abort`` / ``pp.hello`` frame."""
    schema = _CONTROL.get(header.get("kind", ""))
    if schema is None:
        raise _bad(f"not a pipeline control frame: kind {header.get('kind')!r}", ErrorCode.UNKNOWN_KIND)
    return schema.check(header)


def check_epoch(declared: int, current: int, what: str = "stream") -> None:
    """Refuse a sender that speaks for another allocation epoch than this receiver's.

    An older epoch is STALE (that allocation was superseded: its frames could carry steps and
    AC-SGD deltas this epoch's reset buffers know nothing of); a newer one is FROM_FUTURE (the
    sender adopted a commit this peer has not yet: it may retry once this peer caught up).
    """
    if declared < current:
        raise _bad(f"{what} of epoch {declared}: this peer runs epoch {current}", ErrorCode.STALE)
    if declared > current:
        raise _bad(f"{what} of epoch {declared}: this peer still runs epoch {current}", ErrorCode.FROM_FUTURE)


class Assembler:
    """Collects the parts of one message at a time; parts must arrive in order with identical metadata."""

    def __init__(self, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.reset()

    @property
    def busy(self) -> bool:
        """Whether a message has started and not completed."""
        return self._msg is not None

    def reset(self) -> None:
        self._msg: TensorMessage | None = None
        self._count = 0
        self._buf = bytearray()
        self._keep = True
        self._filled = 0
        self._next = 0

    def feed(
        self, part: Part, payload: bytearray | memoryview, *, keep: bool = True
    ) -> tuple[TensorMessage, bytearray] | None:
        """Add one part; return ``(message, payload)`` once the last part is in, else None.

        ``keep=False`` (a resend that will be dropped): parts are checked as usual but not
        buffered, whatever size they announce; the payload returned is then meaningless.

        Raises TRUNCATED when the last part leaves the payload short, MALFORMED for parts out of
        order, with changed metadata or carrying more than announced, OVERSIZED above
        ``max_bytes``. The assembler is reset after an error, so the next message starts clean.
        """
        try:
            return self._feed(part, payload, keep)
        except ProtocolError:
            self.reset()
            raise

    def _feed(
        self, part: Part, payload: bytearray | memoryview, keep: bool
    ) -> tuple[TensorMessage, bytearray] | None:
        msg = part.message
        if msg.nbytes > self.max_bytes:
            raise _bad(f"message of {msg.nbytes} B above the limit {self.max_bytes} B", ErrorCode.OVERSIZED)
        if part.index == 0:
            if self._msg is not None:
                raise _bad(f"message seq {msg.seq} started before seq {self._msg.seq} was complete")
            if part.count == 1:  # the common case: the frame's buffer is the message, no copy
                return msg, _whole(msg, payload, part.offset)
            self._msg, self._count, self._keep = msg, part.count, keep
            self._buf = bytearray(msg.nbytes if keep else 0)
        elif self._msg is None or msg != self._msg or part.count != self._count:
            raise _bad(f"part {part.index} of message seq {msg.seq} does not continue the current message")
        if part.index != self._next or part.offset != self._filled:
            raise _bad(
                f"part {part.index} at offset {part.offset} out of order "
                f"(expected part {self._next} at offset {self._filled})"
            )
        end = self._filled + len(payload)
        if end > msg.nbytes:
            raise _bad(f"parts of message seq {msg.seq} carry more than the announced {msg.nbytes} B")
        if self._keep:
            self._buf[self._filled : end] = payload
        self._filled, self._next = end, self._next + 1
        if self._next < self._count:
            return None
        buf = self._buf
        self.reset()
        if end < msg.nbytes:
            raise _bad(f"message seq {msg.seq} ended after {end} of {msg.nbytes} B", ErrorCode.TRUNCATED)
        return msg, buf


def _whole(msg: TensorMessage, payload: bytearray | memoryview, offset: int) -> bytearray:
    if offset != 0:
        raise _bad(f"single-part message seq {msg.seq} starts at offset {offset}")
    if len(payload) < msg.nbytes:
        raise _bad(f"message seq {msg.seq} ended after {len(payload)} of {msg.nbytes} B", ErrorCode.TRUNCATED)
    if len(payload) > msg.nbytes:
        raise _bad(f"message seq {msg.seq} carries {len(payload)} B, announced {msg.nbytes} B")
    return payload if isinstance(payload, bytearray) else bytearray(payload)


# ---------------------------------------------------------------- decoding: against what this stage expects


IdsOf = Callable[[int, int], Sequence[int] | None]  # (step, mb) -> the micro-batch's ids, None if no such mb


@dataclass(frozen=True)
class Expectation:
    """What a receiving stage accepts on one stream (everything the sender cannot choose)."""

    job: str
    kind: str  # FORWARD_KINDS on a stage's upstream stream, BACKWARD_KINDS on its downstream stream
    boundary: int
    codec: str
    dtype: str
    row_shape: tuple[int, ...]  # per example: (T, C)
    steps: tuple[int, int]  # accepted steps, inclusive: the current one and the next
    ids_of: IdsOf
    shape: tuple[int, ...] | None = None  # a fixed message shape (norm frames); None: (ids, *row_shape)


def norm_expectation(job: str, kind: str, boundary: int, step: int) -> Expectation:
    """What a stage accepts as a norm frame: micro-batch 0 of the current or next step, no ids, one float64."""
    return Expectation(
        job, kind, boundary, RAW_CODEC, NORM_DTYPE, (), (step, step + 1), _no_ids, shape=NORM_SHAPE
    )


def _no_ids(step: int, mb: int) -> Sequence[int] | None:
    return () if mb == 0 else None


def check_message(msg: TensorMessage, expect: Expectation, *, accepted: bool = False) -> None:
    """Reject a message this stage cannot use, with the code that says why (see the spec's table).

    ``accepted``: a resend of a message this stream already took (its step may be over, so
    step and ids are not checked); everything else is, which bounds what it may make us buffer.
    """
    if msg.kind != expect.kind:
        raise _bad(
            f"{msg.kind} frames are not accepted on this stream (takes {expect.kind})", ErrorCode.NOT_ALLOWED
        )
    if msg.job != expect.job:
        raise _bad(f"frame for job {msg.job!r}, this stream serves job {expect.job!r}", ErrorCode.NOT_ALLOWED)
    if msg.boundary != expect.boundary:
        raise _bad(f"frame for boundary {msg.boundary}, this stream is boundary {expect.boundary}")
    if not accepted:
        _check_step(msg, expect)
    if msg.dtype != expect.dtype:
        raise _bad(f"dtype {msg.dtype}, this boundary carries {expect.dtype}", ErrorCode.DTYPE_MISMATCH)
    want_shape = expect.shape or (len(msg.ids), *expect.row_shape)  # the micro-batch's ids, once checked
    if msg.shape != want_shape:
        raise _bad(f"shape {list(msg.shape)}, expected {list(want_shape)}", ErrorCode.SHAPE_MISMATCH)
    if msg.codec != expect.codec:
        raise _bad(f"codec {msg.codec!r}, this boundary uses {expect.codec!r}", ErrorCode.UNKNOWN_CODEC)
    raw = math.prod(want_shape) * DTYPES[msg.dtype].itemsize
    if msg.codec == RAW_CODEC and msg.nbytes != raw:
        raise _bad(
            f"raw payload of {msg.nbytes} B for shape {list(msg.shape)} ({raw} B)", ErrorCode.SHAPE_MISMATCH
        )
    # a compressed tensor is never bigger than its fp32 values plus headers: bounds what we buffer
    limit = math.prod(want_shape) * 4 + COMPRESSED_SLACK + 32 * len(msg.ids)
    if msg.nbytes > limit:
        raise _bad(f"{msg.nbytes} B for a {list(msg.shape)} tensor (at most {limit} B)", ErrorCode.OVERSIZED)


def _check_step(msg: TensorMessage, expect: Expectation) -> None:
    lo, hi = expect.steps
    if not lo <= msg.step <= hi:
        raise _bad(f"frame for step {msg.step}, expecting steps {lo}..{hi}", ErrorCode.WRONG_STEP)
    ids = expect.ids_of(msg.step, msg.mb)
    if ids is None:
        raise _bad(f"step {msg.step} has no micro-batch {msg.mb}", ErrorCode.WRONG_STEP)
    if tuple(msg.ids) != tuple(ids):
        wanted = set(ids)
        stray = [i for i in msg.ids if i not in wanted]
        what = f"example id {stray[0]} is not" if stray else "example ids are not in the order of"
        raise _bad(f"{what} micro-batch {msg.mb} of step {msg.step}", ErrorCode.UNKNOWN_EXAMPLE)
