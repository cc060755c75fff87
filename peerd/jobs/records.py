"""The v1 job records in the DHT — job, job index, progress — with their canonical msgpack codec.

Spec and byte-exact vectors: ``protocols/jobs.md``, ``protocols/vectors/jobs/``; field readers:
``jobs.wire``. Pure: no hivemind, no clocks. A job record is written only by its owner (under the owner's subkey of
``job_key(id)``); its id is the hash of its immutable part (owner, normalized spec, nonce,
planning terms), so a reader can check that a record really is the job it claims to be and
that nobody but the owner produced it. Cancelling is the owner re-storing the record with
state CANCELLED and a higher ``seq``.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from peerd.errors import ErrorCode, ProtocolError
from peerd.jobs.spec import JobSpec, JobSpecError, parse_job_spec
from peerd.jobs.spec_collect import bare_message
from peerd.jobs.wire import JOB_ID_RE, Fields
from peerd.loading import to_mapping
from peerd.sched.consensus.config import ConsensusTiming
from peerd.swarm.records import PROTOCOL_VERSION
from peerd.wire import canonical_pack, check_envelope, decode_map

JOB_KIND, INDEX_KIND, PROGRESS_KIND = "job", "jobs", "progress"
# hivemind's DHT pipe splits messages above 16 KiB (see swarm.records): every record stays well below.
MAX_JOB_BYTES = 8 * 1024
MAX_INDEX_BYTES = 4 * 1024
MAX_PROGRESS_BYTES = 8 * 1024
MAX_INDEX_IDS = 64  # job ids one owner lists; older ones drop out of the index first
MAX_LOSS_POINTS = 128  # loss history a progress record carries (downsampled beyond it)
MAX_REASON_CHARS = 256
NONCE_BYTES = 16
JOB_ID_BYTES = 16  # 32 hex characters
TIMING_FIELDS = (
    "roster_s",
    "settle_s",
    "search_s",
    "exchange_s",
    "vote_s",
    "adopt_s",
    "max_skew_s",
    "publish_interval_s",
)
_BYTES_KIND_RE = re.compile(r"^[a-z0-9_]{1,32}$")


class JobState(StrEnum):
    PENDING = "pending"  # published; planning has not started (epoch 0 lies ahead)
    PLANNING = "planning"  # peers are agreeing on an allocation
    RUNNING = "running"  # an allocation is committed; stage workers train
    DONE = "done"  # every tasklet finished its steps and left a final checkpoint
    FAILED = "failed"  # training stopped on an error; the reason says which
    CANCELLED = "cancelled"  # the owner cancelled it


TERMINAL = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED})


class TaskState(StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class JobRecord:
    """A job as its owner publishes it; ``job_id`` must equal ``job_id_of(...)`` of the rest."""

    job_id: str
    owner: str  # peer id of the owner key
    swarm: str
    nonce: bytes
    spec: dict[str, Any]  # the normalized JobSpec mapping (every field present, nil included)
    epoch0_start: float  # DHT time at which planning epoch 0 opens its roster
    timing: ConsensusTiming
    created_at: float
    state: JobState
    seq: int  # grows with every re-publication by the owner; the highest wins
    updated_at: float
    reason: str = ""

    def job_spec(self) -> JobSpec:
        return parse_job_spec(self.spec, source=f"job {self.job_id}")

    def with_state(self, state: JobState, now: float, reason: str = "") -> JobRecord:
        return replace(
            self, state=state, seq=self.seq + 1, updated_at=max(now, self.updated_at), reason=reason
        )


@dataclass(frozen=True)
class JobIndex:
    """The job ids one owner publishes in a swarm (under ``jobs_key(swarm)``, the owner's subkey)."""

    owner: str
    job_ids: tuple[str, ...]
    updated_at: float


@dataclass(frozen=True)
class Progress:
    """One tasklet's training progress (under ``progress_key(job)``, its peer's subkey)."""

    job_id: str
    peer: str
    epoch: int  # the committed planning epoch this tasklet runs
    stage: int
    replica: int
    step: int  # steps completed
    steps: int  # steps the job runs
    state: TaskState
    tokens_per_s: float
    updated_at: float
    started_at: float
    loss: float | None = None  # last stage only: the latest step's loss
    losses: tuple[tuple[int, float], ...] = ()  # last stage only: (step, loss), ascending
    bytes: dict[str, int] = field(default_factory=dict)  # wire bytes sent so far, by kind
    reason: str = ""


# ---------------------------------------------------------------- identity of a job


def normalized_spec(spec: JobSpec) -> dict[str, Any]:
    """The spec as the plain mapping a job record carries (every field, defaults filled in)."""
    return to_mapping(spec)


def timing_to_wire(timing: ConsensusTiming) -> dict[str, float]:
    return {name: float(getattr(timing, name)) for name in TIMING_FIELDS}


def job_id_of(
    owner: str, spec: dict[str, Any], nonce: bytes, epoch0_start: float, timing: ConsensusTiming
) -> str:
    """Hex of the first 16 bytes of sha256 over the canonical msgpack of the record's immutable part."""
    terms = {"epoch0_start": float(epoch0_start), "timing": timing_to_wire(timing)}
    body = {"nonce": bytes(nonce), "owner": owner, "planning": terms, "spec": spec}
    return hashlib.sha256(canonical_pack(body)).digest()[:JOB_ID_BYTES].hex()


def new_job_record(
    owner: str,
    swarm: str,
    spec: JobSpec,
    nonce: bytes,
    *,
    now: float,
    epoch0_start: float,
    timing: ConsensusTiming,
) -> JobRecord:
    """A fresh PENDING job record (seq 1) for ``spec`` owned by ``owner``."""
    mapping = normalized_spec(spec)
    return JobRecord(
        job_id=job_id_of(owner, mapping, nonce, epoch0_start, timing),
        owner=owner,
        swarm=swarm,
        nonce=bytes(nonce),
        spec=mapping,
        epoch0_start=float(epoch0_start),
        timing=timing,
        created_at=float(now),
        state=JobState.PENDING,
        seq=1,
        updated_at=float(now),
    )


# ---------------------------------------------------------------- encoding


def job_to_wire(rec: JobRecord) -> dict[str, Any]:
    wire: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "kind": JOB_KIND,
        "job_id": rec.job_id,
        "owner": rec.owner,
        "swarm": rec.swarm,
        "nonce": bytes(rec.nonce),
        "spec": rec.spec,
        "planning": {"epoch0_start": float(rec.epoch0_start), "timing": timing_to_wire(rec.timing)},
        "created_at": float(rec.created_at),
        "state": JobState(rec.state).value,
        "seq": int(rec.seq),
        "updated_at": float(rec.updated_at),
    }
    if rec.reason:
        wire["reason"] = rec.reason
    return wire


def index_to_wire(index: JobIndex) -> dict[str, Any]:
    return {
        "v": PROTOCOL_VERSION,
        "kind": INDEX_KIND,
        "owner": index.owner,
        "job_ids": list(index.job_ids),
        "updated_at": float(index.updated_at),
    }


def progress_to_wire(p: Progress) -> dict[str, Any]:
    wire: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "kind": PROGRESS_KIND,
        "job_id": p.job_id,
        "peer": p.peer,
        "epoch": int(p.epoch),
        "stage": int(p.stage),
        "replica": int(p.replica),
        "step": int(p.step),
        "steps": int(p.steps),
        "state": TaskState(p.state).value,
        "tokens_per_s": float(p.tokens_per_s),
        "bytes": {k: int(v) for k, v in p.bytes.items()},
        "started_at": float(p.started_at),
        "updated_at": float(p.updated_at),
    }
    if p.loss is not None:
        wire["loss"] = float(p.loss)
    if p.losses:
        wire["losses"] = [[int(s), float(v)] for s, v in p.losses]
    if p.reason:
        wire["reason"] = p.reason
    return wire


def _encode(wire: dict[str, Any], limit: int, what: str, decode: Any) -> bytes:
    try:
        raw = canonical_pack(wire)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"{what} not encodable: {exc}") from None
    if len(raw) > limit:
        raise ProtocolError(f"{what} is {len(raw)} bytes (limit {limit})", code=ErrorCode.OVERSIZED)
    decode(raw)  # the same rules on both sides: a bug here never reaches the DHT
    return raw


def encode_job(rec: JobRecord) -> bytes:
    return _encode(job_to_wire(rec), MAX_JOB_BYTES, "job record", decode_job)


def encode_index(index: JobIndex) -> bytes:
    return _encode(index_to_wire(index), MAX_INDEX_BYTES, "job index", decode_index)


def encode_progress(p: Progress) -> bytes:
    return _encode(progress_to_wire(p), MAX_PROGRESS_BYTES, "progress record", decode_progress)


# ---------------------------------------------------------------- decoding


def _timing(f: Fields) -> ConsensusTiming:
    values = {name: f.real(name) for name in TIMING_FIELDS}
    try:
        timing = ConsensusTiming(**values)
        timing.validate()
        return timing
    except Exception as exc:  # ConsensusTiming.validate raises ConfigError naming the field
        raise f.bad("", f"invalid timing: {exc}") from None


def decode_job(raw: bytes) -> JobRecord:
    """Decode a job record and check it structurally, including that its id hashes its immutable part.

    Raises ``ProtocolError`` (MALFORMED, OVERSIZED, UNSUPPORTED_VERSION, UNKNOWN_KIND,
    CONFIG_INVALID when the spec inside does not validate). Ownership is the reader's
    check: the subkey's peer id must be ``owner``.
    """
    m = decode_map(raw, max_bytes=MAX_JOB_BYTES, what="job record")
    check_envelope(m, what="job record", version=PROTOCOL_VERSION, kind=JOB_KIND)
    f = Fields(m, "job record")
    nonce = f.get("nonce")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise f.bad("nonce", f"expected {NONCE_BYTES} bytes")
    spec = f.get("spec")
    if not isinstance(spec, dict):
        raise f.bad("spec", "expected a map")
    planning = f.sub("planning")
    rec = JobRecord(
        job_id=f.job_id(),
        owner=f.peer("owner"),
        swarm=f.text("swarm", 64),
        nonce=nonce,
        spec=spec,
        epoch0_start=planning.real("epoch0_start"),
        timing=_timing(planning.sub("timing")),
        created_at=f.real("created_at"),
        state=f.enum(JobState, "state"),
        seq=f.count("seq"),
        updated_at=f.real("updated_at"),
        reason=f.text("reason", MAX_REASON_CHARS, optional=True),
    )
    try:
        parse_job_spec(spec)
    except JobSpecError as exc:
        first = exc.errors[0]
        raise ProtocolError(
            f"job record: spec.{first.field}: {bare_message(first)} ({len(exc.errors)} problem(s))",
            code=ErrorCode.CONFIG_INVALID,
        ) from None
    expected = job_id_of(rec.owner, spec, nonce, rec.epoch0_start, rec.timing)
    if expected != rec.job_id:
        raise ProtocolError(
            f"job record: job_id {rec.job_id} is not the hash of its content ({expected})",
            code=ErrorCode.BAD_SIGNATURE,
        )
    if rec.updated_at < rec.created_at:
        raise f.bad("updated_at", "earlier than created_at")
    return rec


def decode_index(raw: bytes) -> JobIndex:
    m = decode_map(raw, max_bytes=MAX_INDEX_BYTES, what="job index")
    check_envelope(m, what="job index", version=PROTOCOL_VERSION, kind=INDEX_KIND)
    f = Fields(m, "job index")
    ids = f.get("job_ids")
    if not isinstance(ids, list) or len(ids) > MAX_INDEX_IDS:
        raise f.bad("job_ids", f"expected a list of at most {MAX_INDEX_IDS} job ids")
    for i, job_id in enumerate(ids):
        if not isinstance(job_id, str) or not JOB_ID_RE.fullmatch(job_id):
            raise f.bad(f"job_ids[{i}]", f"{job_id!r} is not a job id")
    if len(set(ids)) != len(ids):
        raise f.bad("job_ids", "lists a job id twice")
    return JobIndex(owner=f.peer("owner"), job_ids=tuple(ids), updated_at=f.real("updated_at"))


def decode_progress(raw: bytes) -> Progress:
    m = decode_map(raw, max_bytes=MAX_PROGRESS_BYTES, what="progress record")
    check_envelope(m, what="progress record", version=PROTOCOL_VERSION, kind=PROGRESS_KIND)
    f = Fields(m, "progress record")
    counters = f.get("bytes", optional=True) or {}
    byte_fields = Fields(counters, "progress record", "bytes.")
    sent = {}
    for kind in counters:
        if not _BYTES_KIND_RE.fullmatch(kind):
            raise f.bad("bytes", f"bad kind name {kind!r}")
        sent[kind] = byte_fields.count(kind)
    points = f.get("losses", optional=True) or []
    if not isinstance(points, list) or len(points) > MAX_LOSS_POINTS:
        raise f.bad("losses", f"expected a list of at most {MAX_LOSS_POINTS} [step, loss] pairs")
    losses = []
    for i, point in enumerate(points):
        ok = isinstance(point, list) and len(point) == 2 and type(point[0]) is int and point[0] >= 0
        if not ok or isinstance(point[1], bool) or not isinstance(point[1], int | float):
            raise f.bad(f"losses[{i}]", "expected [step, loss]")
        if not math.isfinite(point[1]):
            raise f.bad(f"losses[{i}]", "loss must be finite")
        losses.append((point[0], float(point[1])))
    if [s for s, _ in losses] != sorted({s for s, _ in losses}):
        raise f.bad("losses", "steps must be strictly ascending")
    p = Progress(
        job_id=f.job_id(),
        peer=f.peer("peer"),
        epoch=f.count("epoch"),
        stage=f.count("stage"),
        replica=f.count("replica"),
        step=f.count("step"),
        steps=f.count("steps"),
        state=f.enum(TaskState, "state"),
        tokens_per_s=f.real("tokens_per_s"),
        updated_at=f.real("updated_at"),
        started_at=f.real("started_at"),
        loss=f.opt_real("loss", optional=True),
        losses=tuple(losses),
        bytes=sent,
        reason=f.text("reason", MAX_REASON_CHARS, optional=True),
    )
    if p.step > p.steps:
        raise f.bad("step", f"{p.step} exceeds steps {p.steps}")
    return p


def downsample(
    points: list[tuple[int, float]], limit: int = MAX_LOSS_POINTS
) -> tuple[tuple[int, float], ...]:
    """At most ``limit`` points spread evenly over the curve, always keeping the first and the last."""
    if len(points) <= limit:
        return tuple(points)
    picks = sorted({round(i * (len(points) - 1) / (limit - 1)) for i in range(limit)})
    return tuple(points[i] for i in picks)
