"""Stopping asyncio tasks without swallowing the caller's own cancellation."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` and wait until it has ended, whatever it raised.

    The common ``task.cancel(); with suppress(CancelledError): await task`` also swallows a
    cancellation aimed at the caller while it waits, so a stop path that awaits this carries on
    as if nothing happened. Here a cancellation that interrupts the wait propagates (one that was
    delivered before, e.g. in a ``finally`` that cleans up after it, does not stop the cleanup).
    """
    if task is None:
        return
    task.cancel()
    # asyncio.wait, unlike ``await task``, neither passes the caller's cancellation on to ``task``
    # nor raises what ``task`` raised: only a cancellation of this wait raises here
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: the task's own failure is not the caller's business here
