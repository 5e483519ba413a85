"""ASGI middleware in front of every route (no task per request, streams untouched): the Bearer
key on every route but /health, a body whose Content-Length is over the limit refused before it
is read, and the body itself read under two bounds, its size (a chunked body is counted as it
comes) and the client's silence while sending it (`client_timeout_s`, 408 beyond: without it a
client that stops mid-body holds its connection until the front door's own client timeout).

A client that leaves mid-body is answered with nothing and logged in one line (Starlette's
ClientDisconnect, handled in app.py).
"""

from __future__ import annotations

import asyncio
import hmac

from .errors import ApiError

OPEN_PATHS = ("/health",)


class BodyTooLarge(ApiError):
    def __init__(self, limit: int, length: int | str | None = None):
        size = f"{length} bytes" if length is not None else f"over {limit} bytes"
        super().__init__(413, f"the body is {size}; at most {limit} are accepted", None, code="body_too_large")


class ClientSilent(ApiError):
    """The client sent nothing for the timeout while its body was incomplete (the connection closes)."""

    def __init__(self, timeout_s: float):
        super().__init__(408, f"the body did not arrive: the client sent nothing for {timeout_s:g} s", None)

    def response(self):
        answer = super().response()
        answer.headers["Connection"] = "close"
        return answer


def key_refusal() -> ApiError:
    return ApiError(
        401, "a valid API key is required: Authorization: Bearer <key>", None, "authentication_error", "invalid_api_key"
    )


class RequestLimits:
    """The key, the body's size and the client's silence mid-body (see the module docstring)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, client_timeout_s: float):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.client_timeout_s = client_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal.response()(scope, receive, send)
            return
        await self.app(scope, self._body_receive(receive), send)

    def _refusal(self, scope) -> ApiError | None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return BodyTooLarge(self.max_body_bytes, length)
        if self.api_key and scope["path"] not in OPEN_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return key_refusal()
        return None

    def _body_receive(self, receive):
        """`receive` with the body's bounds; once the body is in, `receive` itself (a route then
        waits on it for the client's disconnect, for as long as its answer takes)."""
        received, complete = 0, False

        async def body_receive():
            nonlocal received, complete
            if complete:
                return await receive()
            try:
                async with asyncio.timeout(self.client_timeout_s):
                    message = await receive()
            except TimeoutError:
                raise ClientSilent(self.client_timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
                complete = not message.get("more_body", False)
            return message

        return body_receive
