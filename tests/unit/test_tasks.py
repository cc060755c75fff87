"""cancel_and_wait: stops a task; the stop path after it runs to the end."""

from __future__ import annotations

import asyncio
import contextlib

from peerd.tasks import cancel_and_wait


async def _sleeper() -> None:
    await asyncio.sleep(3600)


def test_a_task_is_cancelled_and_awaited() -> None:
    async def main() -> asyncio.Task:
        task = asyncio.create_task(_sleeper())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        return task

    assert asyncio.run(main()).cancelled()


def test_a_task_that_failed_or_is_none_is_fine() -> None:
    async def boom() -> None:
        raise RuntimeError("its own failure")

    async def main() -> None:
        task = asyncio.create_task(boom())
        await asyncio.sleep(0)
        await cancel_and_wait(task)
        await cancel_and_wait(None)

    asyncio.run(main())


def test_cleanup_after_a_cancellation_still_runs() -> None:
    done: list[str] = []

    async def worker() -> None:
        helper = asyncio.create_task(_sleeper())
        try:
            await asyncio.sleep(3600)
        finally:  # cancelled above; the cleanup stops its helper and goes on
            await cancel_and_wait(helper)
            done.append("cleaned up")

    async def main() -> None:
        task = asyncio.create_task(worker())
        await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert done == ["cleaned up"]
