"""Small work runs on the event loop, large work in a worker thread (``peerd.jobs.rl.trainer``)."""

from __future__ import annotations

import asyncio
import threading

from peerd.jobs.rl.trainer import INLINE_TOKENS, INLINE_WEIGHTS, _small_inline


def test_work_up_to_the_limit_runs_on_the_loop_and_beyond_it_in_a_worker_thread() -> None:
    async def where(size: int, limit: int) -> str:
        return await _small_inline(size, limit, lambda: threading.current_thread().name)

    async def run() -> tuple[str, str, str]:
        loop_thread = threading.current_thread().name
        return (
            loop_thread,
            await where(INLINE_WEIGHTS, INLINE_WEIGHTS),
            await where(INLINE_TOKENS + 1, INLINE_TOKENS),
        )

    loop_thread, small, large = asyncio.run(run())
    assert small == loop_thread
    assert large != loop_thread
