"""A client that leaves stops its generation, streamed or not.

The server learns that a client left from uvicorn's `http.disconnect` (the connection closed or
reset; behind the front door, the proxy closes its connection to the API when its client goes).
The generation then runs as a task of its own, and the request's task watches for that message
beside it: when the client leaves first, the generation is cancelled once, and its own cleanup
(cancelling the gRPC stream, so the generate model stops the request at its next step and counts
it in `generate_cancelled_total`) runs to its end. Starlette's StreamingResponse is not used: it
cancels the response inside an anyio cancel scope, which cancels every later await of that cleanup
again, so the gRPC stream was left running.

`EventStream` sends Server-Sent Events of a generation: the first event is awaited before the
status line, so a request refused before its first token gets its 4xx; a failure later is sent as
an `{"error": ...}` event before `data: [DONE]`. Between events it yields to the event loop, so one
stream with many events ready neither starves other requests nor renders events for a client that
has gone.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import Response

from .encoding import sse_event
from .errors import ApiError

logger = logging.getLogger("triton_sampling_mask.api")
DONE = b"data: [DONE]\n\n"


class ClientLeft(Exception):
    """The client closed its connection before its answer was sent."""


async def wait_for_disconnect(receive) -> None:
    """Return once the client has gone (ASGI `http.disconnect`); the body must have been read."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _stop(task: asyncio.Task) -> None:
    """Cancel `task` once and wait for its cleanup; a cancellation of the waiter does not reach it
    again (asyncio.wait, unlike gather, never cancels what it waits for)."""
    if not task.done():
        task.cancel()
        await asyncio.wait((task,))


async def unless_client_leaves(receive, awaitable):
    """The result of `awaitable`, run as a task of its own; when the client leaves first it is
    cancelled (see the module docstring) and ClientLeft is raised."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the request itself was cancelled (the server stops)
        gone.cancel()
        await _stop(work)
        raise
    gone.cancel()
    if not work.done():
        await _stop(work)
        raise ClientLeft
    return work.result()


class EventStream(Response):
    """Server-Sent Events of `deltas` (an async iterator), each `render`ed to a JSON payload, after
    `opening` and before `closing()` and `data: [DONE]`; `error_of` turns an exception into the
    ApiError it is answered with; `done` is called once the stream has ended, however it ended
    (see the module docstring)."""

    media_type = "text/event-stream"

    def __init__(self, deltas, render, error_of, opening: list[dict] = (), closing=list, done=None):
        self.deltas, self.render, self.error_of = deltas, render, error_of
        self.opening, self.closing, self.done = opening, closing, done
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        sender = asyncio.ensure_future(self._send(scope, send))
        gone = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait((sender, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            await _stop(sender)
            if self.done is not None:
                self.done()
        if not sender.cancelled() and sender.exception() is not None:
            raise sender.exception()

    async def _send(self, scope, send) -> None:
        iterator = self.deltas.__aiter__()
        try:
            try:
                first = await iterator.__anext__()
            except StopAsyncIteration:
                first = None
            except Exception as error:  # before the status line: the request's own status
                await self.error_of(error).response()(scope, _nothing_received, send)
                return
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                for chunk in self.opening:
                    await self._event(send, sse_event(chunk))
                if first is not None:
                    await self._event(send, sse_event(self.render(first)))
                    async for delta in iterator:
                        await self._event(send, sse_event(self.render(delta)))
                        await asyncio.sleep(0)  # the disconnect watcher and other requests run
                for chunk in self.closing():
                    await self._event(send, sse_event(chunk))
            except Exception as error:  # after the status line: the error travels in the stream
                await self._event(send, sse_event(self.error_of(error).body()))
            await self._event(send, DONE)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await iterator.aclose()

    @staticmethod
    async def _event(send, data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})


async def _nothing_received():
    return {"type": "http.disconnect"}


def answer_error(error: Exception, to_api_error) -> ApiError:
    """`to_api_error(error)`, or a logged 500 for what it cannot map (a bug)."""
    try:
        return to_api_error(error)
    except Exception as unexpected:
        logger.error("unexpected error in a generation", exc_info=unexpected)
        return ApiError(500, f"internal error: {type(unexpected).__name__}", None, "internal_error")
