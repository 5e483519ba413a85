"""Every refusal of the API as OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`,
with the HTTP status that says whose fault it was: 400 for the request, 401 for the key, 404 for an
unknown model or route, 413 for a body past the limit, 503 with `Retry-After` when the model is busy
or unreachable. SGLang's `/generate` answers in the same shape (its clients read the status and
the message)."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ..client.generate_transport import IN_BAND, GenerateError
from ..sampling.validation import SamplingRequestError

INVALID_REQUEST = "invalid_request_error"
SERVICE_UNAVAILABLE = "service_unavailable"
# gRPC codes of a failed call that a later try may get past.
_UNAVAILABLE_CODES = ("StatusCode.UNAVAILABLE", "StatusCode.RESOURCE_EXHAUSTED", "503")
# An address a transport error may name (gRPC writes "ipv4:127.0.0.1:8001"): the model server's
# port is internal, so no answer carries one.
_ADDRESS = re.compile(
    r"(?:ipv4:|ipv6:|unix:|dns:(?://[^/\s]*/)?)?(?:\[[0-9A-Fa-f:.%]+\]|\d{1,3}(?:\.\d{1,3}){3}|localhost)(?::\d+)?"
)
INTERNAL_SERVER = "the model server"


class ApiError(Exception):
    """A refusal: the HTTP status, OpenAI's error fields, and for 503 the seconds to wait."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        error_type: str = INVALID_REQUEST,
        code: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.error_type, self.code, self.retry_after_s = error_type, code, retry_after_s

    def body(self) -> dict:
        """The error as OpenAI's JSON body."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    """A 400 naming the field to fix."""
    return ApiError(400, message, param)


def from_sampling_error(error: SamplingRequestError, renames: dict[str, str] | None = None) -> ApiError:
    """A parameter refused by the server's own rules (plugin/sampling/validation.py), as a 400
    naming the field as this dialect spells it."""
    field = (renames or {}).get(error.field, error.field)
    return ApiError(400, error.message, field, code=error.reason)


def without_addresses(message: str, internal_url: str | None = None) -> str:
    """`message` without the internal addresses it may name: tritonserver's `internal_url` (and the
    client's `replica <url>: ` prefix) and any IP address, each said as INTERNAL_SERVER."""
    if internal_url:
        message = message.replace(f"replica {internal_url}: ", "").replace(internal_url, INTERNAL_SERVER)
    return _ADDRESS.sub(INTERNAL_SERVER, message)


def from_generate_error(
    error: GenerateError, retry_after_s: int, param: str | None = None, internal_url: str | None = None
) -> ApiError:
    """The generate model's refusal or failure: busy or unreachable as 503 (with Retry-After), a
    request it refused as 400, anything else as 502 (the model failed, not the request); the
    message names no internal address."""
    message = without_addresses(error.message, internal_url)
    if error.busy or error.status is None or error.status in _UNAVAILABLE_CODES:
        what = "the generate model is busy" if error.busy else "the generate model is unavailable"
        return ApiError(503, f"{what}: {message}", None, SERVICE_UNAVAILABLE, "overloaded", retry_after_s)
    if error.status in (IN_BAND, "400", "StatusCode.INVALID_ARGUMENT"):
        # The model answers every rule it checks per request in band (the others the API checked first).
        return ApiError(400, message, param)
    return ApiError(502, f"the generate model failed: {message}", None, "upstream_error", "upstream_error")


# Parts of a pydantic error location that name a member of a union type, not a field.
_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


def _location(loc: tuple) -> str:
    """A pydantic error location as a field path: `messages[0].content` (union members left out)."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif str(part) not in _TYPE_TAGS and "[" not in str(part) and not str(part)[:1].isupper():
            text += ("." if text else "") + str(part)
    return text


def from_validation_error(error: ValidationError, prefix: str = "") -> ApiError:
    """A body that is not JSON, or does not fit the schema: a 400 naming each offending field
    (unknown fields by name), at most a few of them; `prefix` is the path of the part validated."""
    problems, first, seen = [], None, {}
    for item in error.errors(include_url=False):
        where = _location(tuple(item.get("loc", ())))
        where = f"{prefix}.{where}" if prefix and where and not where.startswith("[") else prefix + where
        if where in seen:  # another member of a union: one line per field
            problems[seen[where]] += f", or {item['msg'][0].lower()}{item['msg'][1:]}"
            continue
        if len(problems) == 5:
            break
        seen[where] = len(problems)
        if item["type"] == "json_invalid":
            problems.append(f"the body is not valid JSON: {item['msg']}")
            continue
        if item["type"] in ("json_type", "model_type", "dict_type") and not where:
            problems.append("the body must be a JSON object")
            continue
        if item["type"] == "extra_forbidden":
            problems.append(f"unknown field '{where}' (the accepted fields and extensions: docs/api.md)")
        else:
            problems.append(f"{where}: {item['msg']}")
        first = first or where
    return ApiError(400, "; ".join(problems), first)
