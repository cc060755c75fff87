"""One peer's progress record for one job, kept alive in the DHT: the heartbeat the health check reads.

Both job runners (pipeline tasklets and rl roles) publish through a ``ProgressPublisher``: a
record every ``interval`` seconds, also while a step computes or waits, and sooner after
``poke`` (a step finished, the state changed). While the tasklet runs, records are spaced at
least ``interval`` apart (a fast pipeline would otherwise publish every step); any other state
change goes out at once, since the other peers act on it. Expirations strictly increase:
hivemind keeps the value of a subkey with the latest expiration.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from peerd.errors import PeerdError, ProtocolError
from peerd.jobs.records import Progress, encode_progress
from peerd.jobs.store import RecordStore
from peerd.log import get_logger
from peerd.swarm.keys import progress_key
from peerd.tasks import cancel_and_wait, within

logger = get_logger(__name__)

PROGRESS_TTL_S = 24 * 3600.0
"""A progress record outlives its peer by a day: a finished job's curve stays readable."""


class ProgressPublisher:
    """Publishes ``progress()`` under the job's progress key: ``publish`` now, ``start`` the heartbeat."""

    def __init__(
        self,
        store: RecordStore,
        job_id: str,
        progress: Callable[[], Progress | None],
        *,
        interval: float,
        paced: Callable[[], bool] = lambda: False,
    ) -> None:
        self.store, self.job_id, self.progress, self.interval = store, job_id, progress, interval
        self.paced = paced  # true while records must be spaced ``interval`` apart (a running tasklet)
        self._dirty = asyncio.Event()
        self._expires = 0.0
        self._task: asyncio.Task | None = None

    def poke(self) -> None:
        """Publish soon: something the other peers read has changed."""
        self._dirty.set()

    async def publish(self) -> bool:
        """Store the current record now; False when there is none (no tasklet) or the store refused it."""
        record = self.progress()
        if record is None:
            return False
        self._expires = max(self.store.now() + PROGRESS_TTL_S, self._expires + 1e-3)
        return await self.store.put(progress_key(self.job_id), encode_progress(record), self._expires)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def stop(self, *, final: bool = True) -> None:
        """End the heartbeat; with ``final``, publish the last record (best effort)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if final:
            with contextlib.suppress(PeerdError):
                await self.publish()

    async def _loop(self) -> None:
        last = -1.0
        while True:
            with contextlib.suppress(TimeoutError):
                await within(self._dirty.wait(), self.interval)
            wait = self.interval - (time.monotonic() - last)
            if wait > 0 and self.paced():
                await asyncio.sleep(wait)
            self._dirty.clear()
            last = time.monotonic()
            try:
                await self.publish()
            except ProtocolError as exc:  # our own record fails the checks every reader runs: a bug
                logger.warning("job %s: this peer's progress record is refused: %s", self.job_id, exc)
            except PeerdError as exc:
                logger.debug("job %s: publishing progress failed: %s", self.job_id, exc)
