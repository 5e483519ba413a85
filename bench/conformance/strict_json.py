"""A strict JSON reader: what a client in any language can parse (RFC 8259).

Python's json module accepts NaN, Infinity and -Infinity and reads numbers past float64's range
as inf; JavaScript's JSON.parse, Go's encoding/json, Rust's serde_json and Java's Jackson refuse
the whole document. This reader refuses what any of them refuses, with the reason."""

from __future__ import annotations

import json
import math


class StrictJsonError(ValueError):
    """A body no strict JSON parser accepts; `kind` names the class of defect."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def _refuse_constant(name: str):
    raise StrictJsonError(name, f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise StrictJsonError("number beyond float64", f"{text[:40]} overflows a float64")
    return value


def strict_loads(data: bytes | str):
    """The JSON document in `data` (UTF-8 bytes or text), or StrictJsonError naming the defect:
    a NaN/Infinity constant (kind 'NaN', 'Infinity' or '-Infinity'), a number past float64,
    bytes that are not UTF-8, or a syntax error."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise StrictJsonError("not UTF-8", str(error)) from None
    try:
        return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError as error:
        raise StrictJsonError(
            "syntax error", f"{error.msg} at {error.pos}: {data[max(0, error.pos - 20) : error.pos + 20]!r}"
        ) from None


def sse_data(body: bytes) -> list[bytes]:
    """The payloads of a Server-Sent Events body's `data:` fields, one per event (multi-line data
    joined with newlines, as the SSE specification says)."""
    events, current = [], []
    for line in body.replace(b"\r\n", b"\n").split(b"\n"):
        if line.startswith(b"data:"):
            current.append(line[5:].removeprefix(b" "))
        elif not line and current:
            events.append(b"\n".join(current))
            current = []
    if current:
        events.append(b"\n".join(current))
    return events
