"""The synchronous clients' event-loop thread closes as `asyncio.run` does: no task of the loop's
is left pending to be destroyed later (which asyncio reports as "Task was destroyed but it is
pending!", as a grpc.aio stream's request-writing task was when a GenerateClient closed just
after its stream ended)."""

from __future__ import annotations

import asyncio
import gc
import logging

from triton_sampling_mask.client.loop_thread import LoopThread


def test_closing_cancels_the_loops_pending_tasks_first(caplog):
    loop = LoopThread("test-loop")
    cancelled = []

    async def waits_forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def start_one() -> None:  # a task nobody awaits, as grpc.aio's stream keeps one
        asyncio.get_running_loop().create_task(waits_forever())
        await asyncio.sleep(0)

    async def last() -> None:
        pass

    loop.run(start_one())
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        loop.close(last())
        gc.collect()
    assert cancelled == [True]
    assert "Task was destroyed but it is pending" not in caplog.text
