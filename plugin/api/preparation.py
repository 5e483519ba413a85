"""Preparing requests off the event loop: parsing a body, tokenizing its prompts and rendering its
chat template run on a few threads of their own, so that one large request never stalls the
others' streams (the tokenizers library and transformers' encode release the GIL while they
tokenize; a template renders in Python, which yields the GIL every few milliseconds).

What waits for those threads is bounded by what it holds, the bodies: past `WAITING_BYTES` of
bodies being prepared or waiting to be (or `WAITING_REQUESTS` requests), a new one is refused with
503 and Retry-After (a busy API, as a busy model is answered). Bytes rather than a request count,
so that a trainer's burst of a thousand small requests waits its turn while a few huge bodies are
what fill the queue; a body alone is always taken (the body cap bounds it). A request whose
client left stops waiting, but a preparation already running finishes (a thread cannot be
interrupted); it still counts against the bound until it does.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from .errors import SERVICE_UNAVAILABLE, ApiError

# Bodies already read and waiting for a preparing thread, in bytes (8 bodies at the 32 MiB cap).
WAITING_BYTES = 256 * 2**20
# Requests waiting at most: the engine's own queue (max_waiting) holds as many.
WAITING_REQUESTS = 4096


class PreparationPool:
    """A bounded pool of preparing threads (see the module docstring)."""

    def __init__(self, threads: int, retry_after_s: int):
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="api-prepare")
        self.capacity, self.capacity_bytes = WAITING_REQUESTS, WAITING_BYTES
        self.retry_after_s = retry_after_s
        self._pending = 0
        self._pending_bytes = 0

    async def run(self, function, body: bytes):
        """`function(body)` on a preparing thread; 503 when the pool is full."""
        size = len(body)
        full = self._pending_bytes and self._pending_bytes + size > self.capacity_bytes
        if full or self._pending >= self.capacity:
            raise ApiError(
                503,
                f"the API is busy preparing {self._pending} other requests ({self._pending_bytes} bytes); "
                "retry with backoff",
                None,
                SERVICE_UNAVAILABLE,
                "overloaded",
                self.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        self._pending += 1
        self._pending_bytes += size
        work = self._executor.submit(function, body)
        # Counted until the thread is done with it, even when the waiting request is cancelled.
        work.add_done_callback(lambda _: self._done_from_thread(loop, size))
        return await asyncio.wrap_future(work)

    def _done_from_thread(self, loop, size: int) -> None:
        try:
            loop.call_soon_threadsafe(self._done, size)
        except RuntimeError:  # the loop has closed (shutting down)
            pass

    def _done(self, size: int) -> None:
        self._pending -= 1
        self._pending_bytes -= size

    @property
    def pending(self) -> int:
        """Requests being prepared or waiting to be."""
        return self._pending

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
