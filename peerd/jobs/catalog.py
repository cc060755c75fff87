"""Reading the swarm's jobs from the DHT: owners' job indexes, job records, progress and commit records.

Pure reading and checking, no decisions: every function takes a ``RecordStore`` and returns
validated records, dropping (and logging) anything malformed or forged. The ownership rule
lives here: a job record counts only if it was stored under the subkey of the owner it names
(whose key the record's id hashes), so nobody else can publish, alter or cancel a job.
"""

from __future__ import annotations

from dataclasses import dataclass

from peerd.errors import ErrorCode, ProtocolError
from peerd.jobs.records import (
    JobIndex,
    JobRecord,
    Progress,
    decode_index,
    decode_job,
    decode_progress,
)
from peerd.jobs.store import RecordStore
from peerd.log import get_logger
from peerd.swarm.keys import job_key, jobs_key, progress_key
from peerd.swarm.records import MAX_CLOCK_SKEW_S

logger = get_logger(__name__)


@dataclass
class Rejections:
    """Why records were dropped (for ``peerd status`` and tests)."""

    not_owner: int = 0
    malformed: int = 0
    from_future: int = 0

    def count(self, exc: ProtocolError) -> None:
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
