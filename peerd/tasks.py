"""Stopping asyncio tasks on shutdown and re-plan paths."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` and wait until it has ended, whatever it raised.

    Stop paths call this and then release what the task used (streams, workers, files), so the
    wait absorbs a cancellation of the caller too: the cleanup after it must run to the end (a
    stop path cut short left a worker serving its protocol). A caller that must honour its own
    cancellation checks ``asyncio.current_task().cancelling()`` afterwards.
    """
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
