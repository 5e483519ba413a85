"""JSON over HTTP for the compat tests, and field paths as the fixtures write them
("meta_info.output_token_logprobs[*][1]")."""

from __future__ import annotations

import base64
import json
import re
import urllib.error
import urllib.request

import numpy as np


def post(url: str, body, headers: dict | None = None, timeout_s: float = 120) -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        text = error.read().decode(errors="replace")
        try:
            return error.code, json.loads(text)
        except ValueError:
            return error.code, text


def get(url: str, timeout_s: float = 30) -> tuple[int | None, object]:
    """(status, JSON or text); (None, why) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status, text = response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode(errors="replace")
    except OSError as error:
        return None, type(error).__name__
    try:
        return status, json.loads(text or "null")
    except ValueError:
        return status, text


_STEP = re.compile(r"([^.\[\]]+)|\[(\*|\d+)\]")


def read(document, path: str):
    """The value at `path`; `[*]` maps the rest of the path over a list. KeyError/IndexError when absent."""
    steps = [name or index for name, index in _STEP.findall(path)]

    def walk(value, rest):
        if not rest:
            return value
        step, *tail = rest
        if step == "*":
            return [walk(item, tail) for item in value]
        if step.isdigit() and isinstance(value, list):
            return walk(value[int(step)], tail)
        return walk(value[step], tail)

    return walk(document, steps)


def int32_array(value) -> list[int]:
    """An int32 array as SGLang's meta_info carries it: base64 of little-endian int32, or a list."""
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype="<i4").tolist()
    return [int(v) for v in value]
