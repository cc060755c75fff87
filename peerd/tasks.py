"""Stopping asyncio tasks on shutdown and re-plan paths; what they are waiting on, for diagnosis."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import sys
import threading
import traceback
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

# a stop path that waited this long on a cancelled task is not cleaning up: the cancel was lost
RECANCEL_S = 60.0


async def within(awaitable: Awaitable[T], timeout: float | None) -> T:
    """``await awaitable``, raising ``TimeoutError`` after ``timeout`` s (None: no limit).

    Use it instead of ``asyncio.wait_for``: on Python 3.11, when a task is cancelled in the
    same loop iteration as the awaitable completes, ``wait_for`` returns the result and the
    cancellation is lost (CPython gh-86296, fixed in 3.12). A loop waiting on an event that was
    just set then ignored its stop, and whoever awaited that stop waited forever: a daemon's
    jobs loop hung stopping a failed job's heartbeat. ``asyncio.timeout`` keeps the cancel.
    """
    async with asyncio.timeout(timeout):
        return await awaitable


async def cancel_and_wait(task: asyncio.Task | None, *, recancel_s: float = RECANCEL_S) -> None:
    """Cancel ``task`` and wait until it has ended, whatever it raised.

    Stop paths call this and then release what the task used (streams, workers, files), so the
    wait absorbs a cancellation of the caller too: the cleanup after it must run to the end (a
    stop path cut short left a worker serving its protocol). A caller that must honour its own
    cancellation checks ``asyncio.current_task().cancelling()`` afterwards.

    A task still running ``recancel_s`` after its cancel lost it (libraries on Python 3.11 use
    ``asyncio.wait_for``, see ``within``): it is cancelled again, with a warning naming where
    it was, rather than hanging the stop path for good.
    """
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        while not task.done():
            try:
                await within(asyncio.shield(task), recancel_s)
            except TimeoutError:
                logger.warning(
                    "task %s still runs %.0f s after its cancel; cancelling it again. It waits in:\n%s",
                    task.get_name(),
                    recancel_s,
                    _stack_of(task),
                )
                task.cancel()
            except Exception:
                pass  # what it raised is its own: stop paths go on
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: no "never retrieved" warning for an error stop paths ignore


def _stack_of(task: asyncio.Task) -> str:
    out = io.StringIO()
    task.print_stack(limit=40, file=out)
    return out.getvalue()


def stacks() -> str:
    """Every asyncio task of the running loop and every thread, with their stacks: what a stuck daemon waits on.

    A task's stack follows its chain of awaits down to the innermost coroutine, so a loop stuck
    in a stop path names the call it waits in. The daemon logs this on SIGUSR1.
    """
    out = io.StringIO()
    try:
        tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    except RuntimeError:  # no running loop: threads only
        tasks = []
    out.write(f"{len(tasks)} asyncio tasks\n")
    for task in tasks:
        out.write(f"--- task {task.get_name()} ({task.get_coro()!r})\n{_stack_of(task)}")
    frames = sys._current_frames()
    out.write(f"{len(frames)} threads\n")
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in frames.items():
        out.write(f"--- thread {names.get(ident, ident)}\n")
        out.write("".join(traceback.format_stack(frame, limit=40)))
    return out.getvalue()
