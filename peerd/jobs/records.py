"""The v1 job records in the DHT — job, job index, progress — declared once as ``peerd.wire`` schemas.

Spec and byte-exact vectors: ``protocols/jobs.md``, ``protocols/vectors/jobs/``. Pure: no
hivemind, no clocks. A job record is written only by its owner (under the owner's subkey of
``job_key(id)``); its id is the hash of its immutable part (owner, normalized spec, nonce,
planning terms), so a reader can check that a record really is the job it claims to be and
that nobody but the owner produced it. Cancelling is the owner re-storing the record with
state CANCELLED and a higher ``seq``. The spec inside a record is checked by the same parser
as a spec file; whatever that parser makes of a peer's bytes ends as a ``ProtocolError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from peerd.errors import ConfigError, ErrorCode, ProtocolError
from peerd.jobs.spec import JobSpec, parse_job_spec
from peerd.loading import to_mapping
from peerd.sched.consensus.config import ConsensusTiming
from peerd.swarm.records import PROTOCOL_VERSION
from peerd.wire import FrozenWireStruct, Schema, canonical_pack, convert, sha256
from peerd.wire.types import AnyReal, Count, JobId, PeerId, Real

# hivemind's DHT pipe splits messages above 16 KiB (see swarm.records): every record stays well below.
MAX_JOB_BYTES = 8 * 1024
MAX_INDEX_BYTES = 4 * 1024
MAX_PROGRESS_BYTES = 8 * 1024
MAX_INDEX_IDS = 64  # job ids one owner lists; older ones drop out of the index first
MAX_LOSS_POINTS = 128  # loss history a progress record carries (downsampled beyond it)
MAX_VAL_POINTS = 64  # held-out loss history a progress record carries (downsampled beyond it)
MAX_STALENESS_BINS = 65  # version lags an rl trainer reports (0..64: RLSpec.staleness is at most 64)
MAX_REASON_CHARS = 256
MAX_SUSPECTS = 16  # partners one progress record may name as suspected
NONCE_BYTES = 16
JOB_ID_BYTES = 16  # 32 hex characters

# Lists and maps inside a record's spec. A spec's longest lists (data.paths) and maps (model.hf)
# hold tens of entries; 8 KiB could carry 4096 one-byte items, each of which, wrongly typed, cost
# the spec parser a Python error object (138 ms and 2.9 MB for one 5 KB record, issue 15's fuzzing).
MAX_SPEC_ITEMS = 256
MAX_SPEC_KEYS = 128

Reason = Annotated[str, Meta(max_length=MAX_REASON_CHARS)]
# A job spec is sections of scalars, lists of scalars and up to two levels of maps (model.overrides,
# rl.task.reward): deeper values are no job spec, and bounding the depth keeps hashing and parsing shallow.
_Leaf = str | int | float | bool | None
_Inner = _Leaf | list[_Leaf] | dict[str, _Leaf]
_Value = _Leaf | list[_Leaf] | dict[str, _Inner]
Spec = dict[str, _Leaf | list[_Leaf] | dict[str, _Value]]


class JobState(StrEnum):
    PENDING = "pending"  # published; planning has not started (epoch 0 lies ahead)
    PLANNING = "planning"  # peers are agreeing on an allocation
    RUNNING = "running"  # an allocation is committed; stage workers train
    RECOVERING = "recovering"  # a tasklet's peer is gone or a step broke: re-planning, restoring state
    DONE = "done"  # every tasklet finished its steps and left a final checkpoint
    FAILED = "failed"  # training stopped on an error; the reason says which
    CANCELLED = "cancelled"  # the owner cancelled it


TERMINAL = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED})


class TaskState(StrEnum):
    RUNNING = "running"
    RECOVERING = "recovering"  # its step broke (a partner vanished?): holds its state, awaits a re-plan
    DONE = "done"
    FAILED = "failed"  # an error no re-plan fixes (the reason says which)
    LEFT = "left"  # its peer drained it and left the swarm


class Timing(FrozenWireStruct, frozen=True):
    """``ConsensusTiming`` as a job record carries it: seconds of DHT time, finite."""

    roster_s: Real
    settle_s: Real
    search_s: Real
    exchange_s: Real
    vote_s: Real
    adopt_s: Real
    max_skew_s: Real
    publish_interval_s: Real


class Planning(FrozenWireStruct, frozen=True):
    """The planning terms of every epoch; part of the job id, so nobody can move them later."""

    epoch0_start: Real  # DHT time at which planning epoch 0 opens its roster
    timing: Timing


class JobRecord(FrozenWireStruct, frozen=True, kw_only=True, tag_field="kind", tag="job"):
    """A job as its owner publishes it; ``job_id`` must equal ``job_id_of(...)`` of the rest."""

    version: int = msgspec.field(default=PROTOCOL_VERSION, name="v")
    job_id: JobId
    owner: PeerId  # peer id of the owner key
    swarm: Annotated[str, Meta(max_length=64)]
    nonce: Annotated[bytes, Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
    spec: Spec  # the normalized JobSpec mapping (every field present, nil included)
    planning: Planning
    created_at: Real
    state: JobState
    seq: Count  # grows with every re-publication by the owner; the highest wins
    updated_at: Real
    reason: Reason = ""  # absent on the wire when empty

    @property
    def epoch0_start(self) -> float:
        return self.planning.epoch0_start

    @property
    def timing(self) -> ConsensusTiming:
        return ConsensusTiming(**msgspec.structs.asdict(self.planning.timing))

    def job_spec(self) -> JobSpec:
        return parse_job_spec(self.spec, source=f"job {self.job_id}")

    def with_state(self, state: JobState, now: float, reason: str = "") -> JobRecord:
        updated = max(now, self.updated_at)
        return msgspec.structs.replace(self, state=state, seq=self.seq + 1, updated_at=updated, reason=reason)


class JobIndex(FrozenWireStruct, frozen=True, tag_field="kind", tag="jobs"):
    """The job ids one owner publishes in a swarm (under ``jobs_key(swarm)``, the owner's subkey)."""

    owner: PeerId
    job_ids: Annotated[tuple[JobId, ...], Meta(max_length=MAX_INDEX_IDS)]  # oldest first
    updated_at: Real
    version: int = msgspec.field(default=PROTOCOL_VERSION, name="v")


MAX_PHASES = 16
PhaseName = Annotated[str, Meta(pattern=r"^[a-z_]{1,32}$")]


class RLFigures(FrozenWireStruct, frozen=True):
    """An ``rl`` job's trainer: what GRPO did so far (inside its progress record, protocols/jobs.md)."""

    version: Count  # the policy version it publishes
    # (iterations completed, reward mean, pass rate) per iteration, iterations strictly ascending
    rewards: Annotated[tuple[tuple[Count, AnyReal, Real], ...], Meta(max_length=MAX_LOSS_POINTS)] = ()
    kl: AnyReal = 0.0  # mean k3 KL to the reference, latest iteration
    kl_max: AnyReal | None = None  # the largest of any iteration's mean KL so far; absent before the first
    response_len: Real = 0.0  # mean completion tokens, latest iteration
    rollouts_per_s: Real = 0.0  # completions trained on per second, latest iteration
    # completions trained on per second of the iterations after the first (their completions over the
    # sum of their periods, the trainer's own clock); absent before the second iteration
    steady_rollouts_per_s: Real | None = None
    # (version lag, completions trained on with it) over the whole run, lags strictly ascending
    staleness: Annotated[tuple[tuple[Count, Count], ...], Meta(max_length=MAX_STALENESS_BINS)] = ()
    dropped_stale: Count = 0  # completions refused as older than the staleness bound
    dropped_late: Count = 0  # completions that came after their iteration was trained
    shards_missing: Count = 0  # rollout shards the trainer stopped waiting for
    weight_sync_bytes: Count = 0  # policy bytes served to rollout peers
    # median seconds per phase of the iterations after the first (the trainer's wait, score, reference,
    # train, publish, checkpoint; generate: the slowest shard's sampling as its peer reported it);
    # absent before the second iteration
    phases_s: Annotated[dict[PhaseName, Real], Meta(max_length=MAX_PHASES)] | None = None


class Progress(FrozenWireStruct, frozen=True, tag_field="kind", tag="progress"):
    """One tasklet's training progress (under ``progress_key(job)``, its peer's subkey)."""

    job_id: JobId
    peer: PeerId
    epoch: Count  # the committed planning epoch this tasklet runs
    stage: Count
    replica: Count
    step: Count  # steps completed
    steps: Count  # steps the job runs
    state: TaskState
    tokens_per_s: Real
    updated_at: Real
    started_at: Real
    loss: Real | None = None  # last stage only: the latest step's loss
    # last stage only: (step, loss), steps strictly ascending; absent on the wire when empty
    losses: Annotated[tuple[tuple[Count, AnyReal], ...], Meta(max_length=MAX_LOSS_POINTS)] = ()
    # wire bytes sent so far, by kind
    bytes: dict[Annotated[str, Meta(pattern=r"^[a-z0-9_]{1,32}$")], Count] = msgspec.field(
        default_factory=dict
    )
    reason: Reason = ""  # absent on the wire when empty
    # partners this tasklet saw fail (stream or averaging errors); absent on the wire when empty
    suspects: Annotated[tuple[PeerId, ...], Meta(max_length=MAX_SUSPECTS)] = ()
    replicas: Count = 0  # the epoch's data-parallel width (0: not said); absent on the wire when 0
    # last stage, jobs with a validation split: (steps completed, this replica's held-out loss),
    # steps strictly ascending; absent on the wire when empty (and ignored by readers before it)
    val_losses: Annotated[tuple[tuple[Count, AnyReal], ...], Meta(max_length=MAX_VAL_POINTS)] = ()
    rl: RLFigures | None = None  # an rl job's trainer only; absent otherwise
    version: int = msgspec.field(default=PROTOCOL_VERSION, name="v")

    @property
    def recency(self) -> tuple[float, float, float]:
        """Orders a peer's records: the later epoch, then the further step, then the later update."""
        return (self.epoch, self.step, self.updated_at)


# ---------------------------------------------------------------- identity of a job


def normalized_spec(spec: JobSpec) -> dict[str, Any]:
    """The spec as the plain mapping a job record carries (every field, defaults filled in)."""
    return to_mapping(spec)


def job_id_of(owner: str, spec: dict[str, Any], nonce: bytes, planning: Planning) -> str:
    """Hex of the first 16 bytes of sha256 over the canonical msgpack of the record's immutable part."""
    body = {"nonce": bytes(nonce), "owner": owner, "planning": planning, "spec": spec}
    return sha256(canonical_pack(body))[:JOB_ID_BYTES].hex()


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
    terms = {"epoch0_start": epoch0_start, "timing": dataclasses.asdict(timing)}
    planning = convert(terms, Planning, what="job record")  # reals as floats, as the id hashes them
    return JobRecord(
        job_id=job_id_of(owner, mapping, nonce, planning),
        owner=owner,
        swarm=swarm,
        nonce=bytes(nonce),
        spec=mapping,
        planning=planning,
        created_at=float(now),
        state=JobState.PENDING,
        seq=1,
        updated_at=float(now),
    )


# ---------------------------------------------------------------- checks across fields


def _bad(what: str, path: str, why: str, code: ErrorCode = ErrorCode.MALFORMED) -> ProtocolError:
    return ProtocolError(f"{what}: {path}: {why}", code=code)


def _count_items(tree: dict[str, Any], path: str = "spec") -> None:
    """OVERSIZED naming the first list longer than ``MAX_SPEC_ITEMS`` or map larger than ``MAX_SPEC_KEYS``."""
    if len(tree) > MAX_SPEC_KEYS:
        raise _bad("job record", path, f"{len(tree)} keys (at most {MAX_SPEC_KEYS})", ErrorCode.OVERSIZED)
    for key, value in tree.items():
        if isinstance(value, list) and len(value) > MAX_SPEC_ITEMS:
            why = f"{len(value)} items (at most {MAX_SPEC_ITEMS})"
            raise _bad("job record", f"{path}.{key}", why, ErrorCode.OVERSIZED)
        if isinstance(value, dict):
            _count_items(value, f"{path}.{key}")  # the schema's Spec type bounds the depth to 4


def _check_spec(spec: dict[str, Any]) -> JobSpec:
    """The spec inside a record through the job-spec parser; every failure is a ``ProtocolError``.

    A spec the parser refuses is CONFIG_INVALID naming ``spec.<field>``. The parser was written
    for the owner's own files, so anything else it raises on a peer's bytes is the bytes'
    fault too (MALFORMED), never a crash of the reader.
    """
    try:
        return parse_job_spec(spec)
    except ConfigError as exc:
        first = exc.errors[0]
        path = f"spec.{first.field}" if first.field else "spec"
        why = f"{first.detail} ({len(exc.errors)} problem(s))"
        raise _bad("job record", path, why, ErrorCode.CONFIG_INVALID) from None
    except (TypeError, ValueError, AttributeError, ArithmeticError, LookupError, RecursionError) as exc:
        raise _bad("job record", "spec", f"not a job spec ({type(exc).__name__}: {exc})") from None


def _job_rules(rec: JobRecord) -> None:
    try:
        rec.timing.validate()
    except ConfigError as exc:  # names the window: timing.vote_s
        raise _bad("job record", f"planning.{exc.field}", exc.detail) from None
    _count_items(rec.spec)  # before the parser, whose cost grows with every wrongly typed item
    _check_spec(rec.spec)
    expected = job_id_of(rec.owner, rec.spec, rec.nonce, rec.planning)
    if expected != rec.job_id:
        raise _bad(
            "job record", "job_id", f"{rec.job_id} is not the hash of its content", ErrorCode.BAD_SIGNATURE
        )
    if rec.updated_at < rec.created_at:
        raise _bad("job record", "updated_at", "earlier than created_at")


def _index_rules(index: JobIndex) -> None:
    if len(set(index.job_ids)) != len(index.job_ids):
        raise _bad("job index", "job_ids", "lists a job id twice")


def _progress_rules(p: Progress) -> None:
    for name, points in (("losses", p.losses), ("val_losses", p.val_losses)):
        steps = [s for s, _ in points]
        if steps != sorted(set(steps)):
            raise _bad("progress record", name, "steps must be strictly ascending")
    if p.step > p.steps:
        raise _bad("progress record", "step", f"{p.step} exceeds steps {p.steps}")
    if p.rl is not None:
        iterations = [i for i, _, _ in p.rl.rewards]
        if iterations != sorted(set(iterations)):
            raise _bad("progress record", "rl.rewards", "iterations must be strictly ascending")
        if any(rate > 1 for _, _, rate in p.rl.rewards):
            raise _bad("progress record", "rl.rewards", "a pass rate is at most 1")
        lags = [lag for lag, _ in p.rl.staleness]
        if lags != sorted(set(lags)) or any(lag >= MAX_STALENESS_BINS for lag in lags):
            raise _bad(
                "progress record", "rl.staleness", f"lags strictly ascending, each below {MAX_STALENESS_BINS}"
            )


# protocols/jobs.md: an empty reason or loss list is absent from the record, not written empty.
JOB = Schema(
    JobRecord,
    "job record",
    MAX_JOB_BYTES,
    version=PROTOCOL_VERSION,
    kind="job",
    rules=_job_rules,
    omit_when_empty=frozenset({"reason"}),
)
INDEX = Schema(
    JobIndex, "job index", MAX_INDEX_BYTES, version=PROTOCOL_VERSION, kind="jobs", rules=_index_rules
)
PROGRESS = Schema(
    Progress,
    "progress record",
    MAX_PROGRESS_BYTES,
    version=PROTOCOL_VERSION,
    kind="progress",
    rules=_progress_rules,
    omit_when_empty=frozenset({"reason", "losses", "suspects", "replicas", "val_losses"}),
)

# ---------------------------------------------------------------- codec


def encode_job(rec: JobRecord) -> bytes:
    return JOB.encode(rec)


def encode_index(index: JobIndex) -> bytes:
    return INDEX.encode(index)


def encode_progress(p: Progress) -> bytes:
    return PROGRESS.encode(p)


def decode_job(raw: bytes) -> JobRecord:
    """Decode a job record and check it structurally, including that its id hashes its immutable part.

    Raises ``ProtocolError`` (MALFORMED, OVERSIZED, UNSUPPORTED_VERSION, UNKNOWN_KIND,
    BAD_SIGNATURE, CONFIG_INVALID when the spec inside does not validate). Ownership is the
    reader's check: the subkey's peer id must be ``owner``.
    """
    return JOB.decode(raw)


def decode_index(raw: bytes) -> JobIndex:
    return INDEX.decode(raw)


def decode_progress(raw: bytes) -> Progress:
    return PROGRESS.decode(raw)


_Point = TypeVar("_Point", bound=tuple[Any, ...])


def downsample(points: Sequence[_Point], limit: int = MAX_LOSS_POINTS) -> tuple[_Point, ...]:
    """At most ``limit`` points spread evenly over the curve, always keeping the first and the last."""
    if len(points) <= limit:
        return tuple(points)
    picks = sorted({round(i * (len(points) - 1) / (limit - 1)) for i in range(limit)})
    return tuple(points[i] for i in picks)
