"""An asyncio event loop on a daemon thread of its own: how each synchronous client runs its
asyncio twin (`SamplerClient` over `AsyncSamplerClient`, `GenerateClient` over
`AsyncGenerateClient`), so both flavours share one implementation and are safe to call from
several threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from .replicas import ReplicaAccounts, ReplicatedClient


class LoopThread:
    """An event loop running on a daemon thread; coroutines are handed to it from any thread."""

    def __init__(self, name: str):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine):
        """Run `coroutine` on the loop and wait for its result (its exception is raised here); an
        interrupted wait (e.g. KeyboardInterrupt) cancels it."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def submit(self, coroutine) -> concurrent.futures.Future:
        """Run `coroutine` on the loop without waiting: a Future whose `cancel()` cancels it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def call_soon(self, callback, *args) -> None:
        """Have the loop call `callback(*args)` soon, from any thread (nothing once it is closed)."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nothing left to call it on
            pass

    def close(self, last) -> None:
        """Run the coroutine `last` (the client's own close), then stop the loop and its thread;
        a second close does nothing."""
        if self._loop.is_closed():
            last.close()  # never awaited: silence the "never awaited" warning
            return
        try:
            self.run(last)
        finally:
            self.run(_end_remaining_tasks())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


async def _end_remaining_tasks() -> None:
    """Cancel and await every other task on the loop, then close its async generators, as
    `asyncio.run` does before it closes its loop: a task left pending would be destroyed later
    with a "Task was destroyed but it is pending!" error (grpc.aio leaves a stream's request
    writer running a moment after the stream's end)."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


class LoopClient(ReplicaAccounts):
    """A synchronous client over its asyncio twin `_client`, run on `_loop`: the twin's replica
    accounts, and closing both (a context manager)."""

    _client: ReplicatedClient
    _loop: LoopThread

    def _replicated(self) -> ReplicatedClient:
        return self._client

    def close(self) -> None:
        """Close the asyncio client (its calls in progress cancelled, its connections closed),
        then stop the loop's thread."""
        self._loop.close(self._client.close())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
