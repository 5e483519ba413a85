"""Response bodies as strict JSON bytes (RFC 8259: no NaN, no Infinity), encoded with orjson: a
streamed token's event is encoded once per token, where the standard library's encoder costs
several times more. What orjson refuses (a lone surrogate in a string a client sent) goes through
the standard library's encoder, which escapes it."""

from __future__ import annotations

import json

import orjson
from starlette.responses import Response


def json_bytes(payload) -> bytes:
    """`payload` (dicts, lists, str, int, float, bool, None) as compact JSON."""
    try:
        return orjson.dumps(payload)
    except orjson.JSONEncodeError:
        return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()


def sse_event(payload: dict | str) -> bytes:
    """One Server-Sent Event: `data: <JSON>` (or the text itself, e.g. `[DONE]`)."""
    return b"data: " + (payload.encode() if isinstance(payload, str) else json_bytes(payload)) + b"\n\n"


class JsonBody(Response):
    """A JSON response encoded with `json_bytes`."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return json_bytes(content)
