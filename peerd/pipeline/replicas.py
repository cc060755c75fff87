"""Checkpoint replicas: other stages' checkpoint blobs kept on this peer within a byte budget, served on request.

A stage's checkpoints must outlive the peers of that stage: each peer keeps copies of some
other stages' latest checkpoints (``replicate`` pulls one with ``fetch_state``) and serves
them with a ``StateServer`` whose provider is ``CheckpointReplicas.provider``. Files are the
blobs as fetched (the checkpoint file format), one directory per (job, stage), named like
the stage's own checkpoints (``step-NNNNNNNN.pt``). Writes are atomic (temporary file, fsync,
rename, fsync of the directory); each (job, stage) keeps its newest ``keep`` steps; when the
budget is exceeded the copies of the lowest steps go first, the newest of each (job, stage) last.
Temporary files a crash left behind are deleted when the store is opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from peerd.durable import TMP_PREFIX, replace_file
from peerd.errors import ConfigError, ErrorCode, ProtocolError
from peerd.log import get_logger
from peerd.pipeline import checkpoint
from peerd.pipeline.statesync import (
    PeerRef,
    StateProvider,
    StateSyncConfig,
    fetch_state,
    unpack_state,
)
from peerd.swarm.transport import Transport

logger = get_logger(__name__)


@dataclass(frozen=True)
class _Copy:
    job: str
    stage: int
    step: int
    nbytes: int
    mtime_ns: int


class CheckpointReplicas:
    """Checkpoint blobs of (job, stage, step) under ``root``, at most ``budget_bytes`` in all."""

    def __init__(self, root: str | Path, *, budget_bytes: int, keep: int = 2) -> None:
        if budget_bytes < 1:
            raise ConfigError("replicas.budget_bytes", f"must be >= 1, got {budget_bytes}")
        if keep < 1:
            raise ConfigError("replicas.keep", f"must be >= 1, got {keep}")
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.keep = keep
        # the provider runs in StateServer's worker threads while put() runs on the event loop
        self._lock = threading.Lock()
        self.root.mkdir(parents=True, exist_ok=True)
        removed = self._remove_stale_temporaries()
        if removed:
            logger.info("replicas: removed %d temporary files left in %s", removed, self.root)

    # ---------------------------------------------------------------- reading

    def directory(self, job: str, stage: int) -> Path:
        return self.root / job / f"stage{stage}"

    def steps(self, job: str, stage: int) -> list[int]:
        """Steps held for (job, stage), ascending."""
        return checkpoint.saved_steps(self.directory(job, stage))

    def latest(self, job: str, stage: int) -> int | None:
        steps = self.steps(job, stage)
        return steps[-1] if steps else None

    def get(self, job: str, stage: int, step: int) -> bytes | None:
        """The blob of (job, stage, step), or None when it is not held (or was just pruned)."""
        try:
            return checkpoint.checkpoint_file(self.directory(job, stage), step).read_bytes()
        except OSError:
            return None

    def provider(self, job: str) -> StateProvider:
        """What a ``StateServer`` of ``job`` serves from this store."""
        return lambda stage, step: self.get(job, stage, step)

    @property
    def used_bytes(self) -> int:
        return sum(c.nbytes for c in self._copies())

    # ---------------------------------------------------------------- writing

    def put(self, job: str, stage: int, step: int, blob: bytes) -> Path:
        """Write ``blob`` atomically as (job, stage, step); prune old steps, then evict down to the budget."""
        if len(blob) > self.budget_bytes:
            raise ConfigError(
                "replicas.budget_bytes",
                f"a {len(blob)}-byte checkpoint of stage {stage} does not fit the {self.budget_bytes}-byte budget",
            )
        directory = self.directory(job, stage)
        with self._lock:
            directory.mkdir(parents=True, exist_ok=True)
            final = replace_file(
                checkpoint.checkpoint_file(directory, step), lambda fh: fh.write(blob), suffix=".pt"
            )
            for old in checkpoint.saved_steps(directory)[: -self.keep]:
                self._delete(job, stage, old, f"older than the newest {self.keep}")
            self._evict(keep=(job, stage, step))
        logger.debug("replicas: stored %s (%d B)", final, len(blob))
        return final

    def _evict(self, keep: tuple[str, int, int]) -> None:
        copies = [c for c in self._copies() if (c.job, c.stage, c.step) != keep]
        used = sum(c.nbytes for c in copies) + self._size(*keep)
        newest: dict[tuple[str, int], int] = {}
        for c in copies:  # the newest step of each (job, stage) goes last: it is what a recovery needs
            newest[(c.job, c.stage)] = max(newest.get((c.job, c.stage), -1), c.step)
        # then the lowest step (the least useful for a recovery); mtime only breaks ties, as file
        # times are coarse (one kernel tick, ~4 ms)
        order = sorted(
            copies, key=lambda c: (c.step == newest[(c.job, c.stage)], c.step, c.mtime_ns, c.job, c.stage)
        )
        for c in order:
            if used <= self.budget_bytes:
                break
            self._delete(c.job, c.stage, c.step, f"over the {self.budget_bytes}-byte budget")
            used -= c.nbytes

    def _delete(self, job: str, stage: int, step: int, why: str) -> None:
        with contextlib.suppress(OSError):
            checkpoint.checkpoint_file(self.directory(job, stage), step).unlink()
            logger.info("replicas: dropped job %s stage %d step %d (%s)", job, stage, step, why)

    def _size(self, job: str, stage: int, step: int) -> int:
        try:
            return checkpoint.checkpoint_file(self.directory(job, stage), step).stat().st_size
        except OSError:
            return 0

    def _copies(self) -> list[_Copy]:
        out = []
        for job_dir in _subdirs(self.root):
            for stage_dir in _subdirs(job_dir):
                if not stage_dir.name.startswith("stage") or not stage_dir.name[5:].isdigit():
                    continue
                stage = int(stage_dir.name[5:])
                for step in checkpoint.saved_steps(stage_dir):
                    with contextlib.suppress(OSError):  # pruned meanwhile
                        st = checkpoint.checkpoint_file(stage_dir, step).stat()
                        out.append(_Copy(job_dir.name, stage, step, st.st_size, st.st_mtime_ns))
        return out

    def _remove_stale_temporaries(self) -> int:
        removed = 0
        for job_dir in _subdirs(self.root):
            for stage_dir in _subdirs(job_dir):
                for path in stage_dir.glob(f"{TMP_PREFIX}*"):
                    with contextlib.suppress(OSError):
                        path.unlink()
                        removed += 1
        return removed


def own_checkpoints(root: str | Path, job: str) -> StateProvider:
    """A provider serving this peer's own checkpoints of ``job`` (``checkpoint.save`` files under ``root``).

    Any replica's file of the asked (stage, step) will do: replicas of a stage hold the same state.
    """
    job_dir = Path(root) / job

    def provide(stage: int, step: int) -> bytes | None:
        for directory in sorted(job_dir.glob(f"stage{stage}-replica*")):
            with contextlib.suppress(OSError):
                return checkpoint.checkpoint_file(directory, step).read_bytes()
        return None

    return provide


def check_checkpoint(blob: bytes, job: str, stage: int, step: int) -> None:
    """Raise ProtocolError unless ``blob`` is a peerd checkpoint of exactly (job, stage, step).

    The hash only proves the bytes are the ones the holder described; this proves they are the
    checkpoint that was asked for.
    """
    state = unpack_state(blob)
    missing = [k for k in checkpoint.REQUIRED if k not in state]
    if missing:
        raise ProtocolError(
            f"state blob is no peerd checkpoint: it lacks {missing}", code=ErrorCode.MALFORMED
        )
    if state["format"] != checkpoint.FORMAT:
        raise ProtocolError(
            f"checkpoint format {state['format']!r}, this peer reads {checkpoint.FORMAT}",
            code=ErrorCode.UNSUPPORTED_VERSION,
        )
    got = (state["job"], state["stage"], state["step"])
    if got != (job, stage, step):
        raise ProtocolError(
            f"checkpoint of job {got[0]} stage {got[1]} step {got[2]}, asked for job {job} stage {stage} step {step}",
            code=ErrorCode.WRONG_STEP,
        )


async def replicate(
    transport: Transport,
    holders: Sequence[PeerRef],
    job: str,
    stage: int,
    step: int,
    store: CheckpointReplicas,
    max_bytes: int,
    *,
    config: StateSyncConfig = StateSyncConfig(),
) -> Path:
    """Pull the checkpoint of (job, stage, step) from ``holders`` into ``store``; return its file.

    Nothing is fetched when the store already holds it. Raises StateFetchError when no holder
    delivers, ProtocolError when what was delivered is not that checkpoint (nothing is stored).
    """
    path = checkpoint.checkpoint_file(store.directory(job, stage), step)
    if step in store.steps(job, stage):
        return path
    blob = await fetch_state(
        transport, holders, job, stage, step, max_bytes=min(max_bytes, store.budget_bytes), config=config
    )
    await asyncio.to_thread(check_checkpoint, blob, job, stage, step)  # torch.load of a big blob
    return await asyncio.to_thread(store.put, job, stage, step, blob)


def _subdirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir()]
    except OSError:
        return []
