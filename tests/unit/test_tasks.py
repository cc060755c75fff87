"""cancel_and_wait: stops a task, never swallows a cancellation of the caller's wait."""

from __future__ import annotations

import asyncio

import pytest

from peerd.tasks import cancel_and_wait


async def _sleeper(cleanup: float = 0.0) -> None:
    try:
        await asyncio.sleep(3600)
    finally:
        if cleanup:
            await asyncio.shield(asyncio.sleep(cleanup))  # a task that takes a while to stop


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


def test_the_callers_cancellation_during_the_wait_propagates() -> None:
    """Before: ``with suppress(CancelledError): await task`` swallowed it and the stop path went on."""
    after_wait: list[bool] = []

    async def stopper(task: asyncio.Task) -> None:
        await cancel_and_wait(task)
        after_wait.append(True)

    async def main() -> None:
        slow = asyncio.create_task(_sleeper(cleanup=0.5))
        await asyncio.sleep(0)
        outer = asyncio.create_task(stopper(slow))
        await asyncio.sleep(0.05)  # outer waits for slow's cleanup
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await asyncio.sleep(0.6)

    asyncio.run(main())
    assert after_wait == []


def test_cleanup_after_an_earlier_cancellation_still_runs() -> None:
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
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert done == ["cleaned up"]
