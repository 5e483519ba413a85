"""What every HTTP answer of the server must satisfy, whatever was asked: no 5xx, strict JSON
wherever the content type says JSON (each Server-Sent Event's data too), errors as a JSON object
with an "error" string and Content-Type application/json, and no error carried by a 2xx."""

from __future__ import annotations

from dataclasses import dataclass, field

from .strict_json import StrictJsonError, sse_data, strict_loads

JSON_TYPES = ("application/json",)
EVENT_STREAM = "text/event-stream"


@dataclass(frozen=True)
class Answer:
    """One HTTP exchange's result: status (None when nothing came back, with `error` saying why),
    lower-cased header names, and the body."""

    status: int | None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    error: str = ""

    @property
    def media_type(self) -> str:
        """The Content-Type without its parameters, lower-cased ('' when absent)."""
        return self.headers.get("content-type", "").split(";")[0].strip().lower()


@dataclass(frozen=True)
class Failure:
    """A defect of one answer: its class (what the report groups by) and this instance's detail."""

    kind: str
    detail: str = ""


def _excerpt(body: bytes, limit: int = 100) -> str:
    text = body.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[:limit] + "…"


def _json_failures(answer: Answer, payload: bytes, where: str) -> tuple[list[Failure], object]:
    if not payload.strip():
        return [Failure(f"empty {where} labelled JSON", f"status {answer.status}")], None
    try:
        document = strict_loads(payload)
    except StrictJsonError as error:
        return [Failure(f"{where} not strict JSON: {error.kind}", error.detail)], None
    if answer.status is not None and 200 <= answer.status < 300 and isinstance(document, dict) and "error" in document:
        return [Failure(f"error carried by a {answer.status}", _excerpt(payload))], document
    return [], document


def answer_failures(answer: Answer) -> list[Failure]:
    """Every defect of `answer` that no request can excuse."""
    if answer.status is None:
        return [Failure("no answer", answer.error)]
    failures = []
    if answer.status >= 500:
        failures.append(Failure(f"server error {answer.status}", _excerpt(answer.body)))
    document = None
    if answer.media_type in JSON_TYPES or answer.media_type.endswith("+json"):
        found, document = _json_failures(answer, answer.body, "answer")
        failures += found
    elif answer.media_type == EVENT_STREAM:
        for event in sse_data(answer.body):
            found, _ = _json_failures(answer, event, "event")
            failures += found
    if answer.status >= 400:
        if answer.media_type != "application/json":
            failures.append(
                Failure(
                    f"error answer is {answer.media_type or 'untyped'}, not application/json", _excerpt(answer.body)
                )
            )
        elif document is not None and not (isinstance(document, dict) and isinstance(document.get("error"), str)):
            failures.append(Failure('error answer without an "error" string', _excerpt(answer.body)))
    return failures
