"""The requests in flight by id, so that SGLang's `/abort_request` and vLLM's
`/inference/v1/abort_requests` really stop them.

Each `/generate` and `/inference/v1/generate` request registers its ids (SGLang's `rid`s, vLLM's
`request_id`). An abort marks the registration and, when its task is waiting on the generate
model, cancels that wait: the generation's gRPC calls are cancelled on the server (the engine
frees the rows) and the route answers what the request had when it stopped, with SGLang's
`{"type": "abort"}` / vLLM's `"abort"` finish reason. The wait is all that is cancelled, never
a task writing a response. Aborting one id of a request stops the whole request (its sequences
are generated together).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterable

ABORT_MESSAGE = "aborted by an abort request"


class Registration:
    """One request's ids, whether it was aborted, and the task waiting for its tokens (if any)."""

    def __init__(self, registry: InFlight, ids: tuple[str, ...]):
        self._registry, self.ids = registry, ids
        self.aborted = False
        self._waiting: asyncio.Task | None = None
        self._released = False

    def abort(self) -> None:
        self.aborted = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def run(self, awaitable: Awaitable):
        """`awaitable`'s result, or None when the request was aborted while it ran."""
        if self.aborted:
            getattr(awaitable, "close", lambda: None)()  # never started
            return None
        result = await self._wait(awaitable)
        return None if result is _STOPPED else result

    def stream(self, deltas: AsyncIterator) -> AsyncIterator:
        """`deltas`, ending early (the rest cancelled) when the request is aborted."""
        return _Abortable(self, deltas)

    async def _wait(self, awaitable: Awaitable):
        task = asyncio.current_task()
        self._waiting = task
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self.aborted and task.cancelling():
                task.uncancel()  # our own cancellation: the request answers what it has
                return _STOPPED
            raise
        finally:
            self._waiting = None

    def release(self) -> None:
        """Forget the request (idempotent): it has answered."""
        if not self._released:
            self._released = True
            self._registry._forget(self)


_STOPPED = object()


class _Abortable:
    """An async iterator of deltas that stops when its registration is aborted."""

    def __init__(self, registration: Registration, deltas: AsyncIterator):
        self.registration, self.iterator = registration, deltas.__aiter__()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.registration.aborted:
            raise StopAsyncIteration
        item = await self.registration._wait(self.iterator.__anext__())
        if item is _STOPPED:
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        await self.iterator.aclose()


class InFlight:
    """The registrations of the requests in flight."""

    def __init__(self):
        self._by_id: dict[str, list[Registration]] = {}

    def register(self, ids: Iterable[str]) -> Registration:
        registration = Registration(self, tuple(dict.fromkeys(ids)))
        for request_id in registration.ids:
            self._by_id.setdefault(request_id, []).append(registration)
        return registration

    def _forget(self, registration: Registration) -> None:
        for request_id in registration.ids:
            holders = self._by_id.get(request_id, [])
            if registration in holders:
                holders.remove(registration)
            if not holders:
                self._by_id.pop(request_id, None)

    def abort(self, ids: Iterable[str] = (), everything: bool = False) -> int:
        """Abort the requests holding any of `ids` (every request with `everything`); how many."""
        if everything:
            targets = {id(r): r for holders in self._by_id.values() for r in holders}
        else:
            targets = {id(r): r for request_id in ids for r in self._by_id.get(request_id, ())}
        for registration in targets.values():
            registration.abort()
        return len(targets)
