"""Preparing requests off the event loop: parsing a body, tokenizing its prompts and rendering its
chat template run on a few threads of their own, so that one large request never stalls the
others' streams (the tokenizers library and transformers' encode release the GIL while they
tokenize; a template renders in Python, which yields the GIL every few milliseconds).

What waits for those threads is bounded: past `threads x WAITING_PER_THREAD` requests being
prepared or waiting to be, a new one is refused with 503 and Retry-After (a busy API, as a busy
model is answered). A request whose client left stops waiting, but a preparation already running
finishes (a thread cannot be interrupted); it still counts against the bound until it does.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from .errors import SERVICE_UNAVAILABLE, ApiError

# Requests each preparing thread may have waiting for it (a queue of bodies already read).
WAITING_PER_THREAD = 16


class PreparationPool:
    """A bounded pool of preparing threads (see the module docstring)."""

    def __init__(self, threads: int, retry_after_s: int):
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="api-prepare")
        self.capacity = threads * (1 + WAITING_PER_THREAD)
        self.retry_after_s = retry_after_s
        self._pending = 0

    async def run(self, function, *args):
        """`function(*args)` on a preparing thread; 503 when the pool is full."""
        if self._pending >= self.capacity:
            raise ApiError(
                503,
                f"the API is busy preparing {self._pending} other requests; retry with backoff",
                None,
                SERVICE_UNAVAILABLE,
                "overloaded",
                self.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        self._pending += 1
        work = self._executor.submit(function, *args)
        # Counted until the thread is done with it, even when the waiting request is cancelled.
        work.add_done_callback(lambda _: self._done_from_thread(loop))
        return await asyncio.wrap_future(work)

    def _done_from_thread(self, loop) -> None:
        try:
            loop.call_soon_threadsafe(self._done)
        except RuntimeError:  # the loop has closed (shutting down)
            pass

    def _done(self) -> None:
        self._pending -= 1

    @property
    def pending(self) -> int:
        """Requests being prepared or waiting to be."""
        return self._pending

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
