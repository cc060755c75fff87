"""Reading the swarm's jobs from the DHT: owners' job indexes, job records, progress and commit records.

Pure reading and checking, no decisions: every function takes a ``RecordStore`` and returns
validated records, dropping (and logging) anything malformed or forged. The ownership rule
lives here: a job record counts only if it was stored under the subkey of the owner it names
(whose key the record's id hashes), so nobody else can publish, alter or cancel a job. A
commit record counts only if it was stored under its author's subkey and carries a quorum
of votes that were each found under their voter's subkey (``read_commit``): the same proof
the planner accepts, so a daemon that never planned a job reports the allocation every
planner committed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated

from msgspec import Meta
from msgspec.structs import replace

from peerd.errors import ErrorCode, ProtocolError
from peerd.jobs.records import (
    JobIndex,
    JobRecord,
    Progress,
    decode_index,
    decode_job,
    decode_progress,
)
from peerd.jobs.store import Entry, RecordStore
from peerd.log import get_logger
from peerd.sched.consensus.actions import Commit
from peerd.sched.consensus.messages import CommitRecord, Vote, allocation_hash, decode, encode
from peerd.sched.consensus.tally import Ballot, verify_record
from peerd.swarm.keys import commit_key, job_key, jobs_key, progress_key, votes_key
from peerd.swarm.records import MAX_CLOCK_SKEW_S
from peerd.wire import canonical_pack, decode_value

logger = get_logger(__name__)

MAX_VOTES_BYTES = 16 * 1024
MAX_COMMIT_RECORDS = 64  # commit records one read checks (every planner re-stores one per commit)

# One voter's encoded vote messages, in round order (round 0, then maybe round 1).
VotesEntry = Annotated[list[bytes], Meta(min_length=1, max_length=2)]


@dataclass
class Rejections:
    """Why records were dropped (for ``peerd status`` and tests)."""

    not_owner: int = 0
    malformed: int = 0
    from_future: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    """Every rejection by its error code's name (``peerd status``: refusals.job_records)."""

    def count(self, exc: ProtocolError) -> None:
        self.codes[exc.code.name] = self.codes.get(exc.code.name, 0) + 1
        if exc.code in (ErrorCode.NOT_OWNER, ErrorCode.BAD_SIGNATURE):
            self.not_owner += 1
        elif exc.code == ErrorCode.FROM_FUTURE:
            self.from_future += 1
        else:
            self.malformed += 1


async def read_indexes(store: RecordStore, swarm: str, rejected: Rejections | None = None) -> list[JobIndex]:
    """Every owner's job index in ``swarm`` (an index naming another owner than its subkey is dropped)."""
    out = []
    for entry in await store.read(jobs_key(swarm)):
        try:
            index = decode_index(entry.value)
            if index.owner != entry.author:
                raise ProtocolError(
                    f"index of {index.owner} stored under {entry.author}'s subkey", code=ErrorCode.NOT_OWNER
                )
        except ProtocolError as exc:
            if rejected is not None:
                rejected.count(exc)
            logger.info("skipping job index of %s: %s", entry.author, exc)
            continue
        out.append(index)
    return out


def check_job_entry(job_id: str, author: str, raw: bytes, now: float) -> JobRecord:
    """Decode one entry of ``job_key(job_id)`` and check it is the owner's record of that very job."""
    rec = decode_job(raw)
    if rec.job_id != job_id:
        raise ProtocolError(f"record of job {rec.job_id} stored under job {job_id}", code=ErrorCode.MALFORMED)
    if rec.owner != author:
        raise ProtocolError(
            f"job {job_id} is owned by {rec.owner}; a record stored by {author} does not count",
            code=ErrorCode.NOT_OWNER,
        )
    if rec.updated_at > now + MAX_CLOCK_SKEW_S:
        raise ProtocolError(
            f"job {job_id} record updated {rec.updated_at - now:.0f} s ahead", code=ErrorCode.FROM_FUTURE
        )
    return rec


async def read_job(store: RecordStore, job_id: str, rejected: Rejections | None = None) -> JobRecord | None:
    """The owner's latest record of ``job_id`` (highest ``seq``), or None when there is none."""
    best: JobRecord | None = None
    now = store.now()
    for entry in await store.read(job_key(job_id)):
        try:
            rec = check_job_entry(job_id, entry.author, entry.value, now)
        except ProtocolError as exc:
            if rejected is not None:
                rejected.count(exc)
            logger.info("job %s: ignoring a record stored by %s: %s", job_id, entry.author, exc)
            continue
        if best is None or rec.seq > best.seq:
            best = rec
    return best


async def read_progress(store: RecordStore, job_id: str) -> dict[str, Progress]:
    """Peer id -> its latest tasklet progress for ``job_id`` (records naming another peer are dropped)."""
    out: dict[str, Progress] = {}
    now = store.now()
    for entry in await store.read(progress_key(job_id)):
        try:
            p = decode_progress(entry.value)
            if p.peer != entry.author or p.job_id != job_id:
                raise ProtocolError("progress record of another peer or job", code=ErrorCode.NOT_OWNER)
            if p.updated_at > now + MAX_CLOCK_SKEW_S:
                raise ProtocolError("progress from the future", code=ErrorCode.FROM_FUTURE)
        except ProtocolError as exc:
            logger.debug("job %s: ignoring progress of %s: %s", job_id, entry.author, exc)
            continue
        out[p.peer] = p
    return out


# ---------------------------------------------------------------- commit records


def encode_votes(votes: list[bytes]) -> bytes:
    """The value under ``votes_key``: a msgpack array of one voter's encoded vote messages, round order."""
    return canonical_pack([bytes(v) for v in votes])


def decode_votes(raw: bytes) -> list[bytes]:
    votes: list[bytes] = decode_value(raw, VotesEntry, max_bytes=MAX_VOTES_BYTES, what="votes entry")
    return votes


def voters_votes(entries: Iterable[Entry], epoch: int) -> dict[str, set[bytes]]:
    """Voter -> the encoded votes of ``epoch`` found under that voter's own subkey (the signed ones)."""
    out: dict[str, set[bytes]] = {}
    for entry in entries:
        try:
            items = decode_votes(entry.value)
        except ProtocolError as exc:
            logger.debug("votes entry of %s: %s", entry.author, exc)
            continue
        for raw in items:
            try:
                vote = decode(raw, Vote)
            except ProtocolError:
                continue
            if vote.voter == entry.author and vote.epoch == epoch:
                out.setdefault(vote.voter, set()).add(bytes(raw))
    return out


def authentic_votes(record: CommitRecord, seen: Mapping[str, set[bytes]]) -> list[Vote]:
    """The votes embedded in ``record`` whose exact bytes were found under their voter's subkey."""
    return [v for v in record.votes if encode(v) in seen.get(v.voter, set())]


def equivocators(seen: Mapping[str, set[bytes]], round_: int) -> set[str]:
    """Voters seen with two different votes in ``round_`` (they do not count toward a quorum)."""
    ballot = Ballot()
    for raws in seen.values():
        for raw in sorted(raws):
            vote = decode(raw, Vote)
            if vote.round == round_:
                ballot.add(vote)
    return ballot.equivocators


def commit_of(record: CommitRecord) -> Commit:
    """The ``Commit`` a verified ``record`` proves, at the cost its quorum voted for."""
    cand = record.candidate
    return Commit(
        record.epoch,
        record.round,
        cand.allocation,
        allocation_hash(cand.allocation).hex(),
        cand.id.hex(),
        cand.cost,
        record,
    )


def commit_records(job_id: str, entries: Iterable[Entry]) -> list[CommitRecord]:
    """The commit records of ``job_id`` stored under their authors' subkeys, newest epoch first."""
    out = []
    for entry in entries:
        try:
            record = decode(entry.value, CommitRecord)
        except ProtocolError as exc:
            logger.debug("job %s: commit record of %s: %s", job_id, entry.author, exc)
            continue
        if record.author == entry.author and record.job == job_id:
            out.append(record)
    out.sort(key=lambda r: (-r.epoch, r.round, r.candidate.id, r.author))
    return out[:MAX_COMMIT_RECORDS]


async def read_commit(store: RecordStore, job_id: str, *, faulty: int = 0) -> Commit | None:
    """The newest commit of ``job_id`` that public records prove, or None.

    ``faulty`` is the job's ``ConsensusConfig.faulty`` (0 for every job today). Reads the
    votes of each epoch once, and only for epochs a commit record names.
    """
    records = commit_records(job_id, await store.read(commit_key(job_id)))
    seen_epoch, seen = -1, {}
    for record in records:
        if record.epoch != seen_epoch:
            seen_epoch, seen = (
                record.epoch,
                voters_votes(await store.read(votes_key(job_id, record.epoch)), record.epoch),
            )
        proof = replace(record, votes=tuple(authentic_votes(record, seen)))
        why = verify_record(proof, faulty, equivocators(seen, record.round))
        if why is None:
            return commit_of(proof)
        logger.debug("job %s: commit record of %s does not prove a commit: %s", job_id, record.author, why)
    return None
