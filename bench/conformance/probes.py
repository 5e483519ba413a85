"""Fixed requests with a known right answer: valid calls (200), `\\u` escapes in valid JSON (200),
malformed or mistyped bodies (400), a streamed request on /generate (4xx), unknown paths (404),
wrong methods (405), admin routes without the key (403) and path tricks toward them."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .checks import Failure, answer_failures
from .exchange import curl_line, send
from .tally import Tally

SAMPLER = "/v2/models/sampler/infer"
GENERATE = "/v2/models/generate/generate"
GENERATE_STREAM = "/v2/models/generate/generate_stream"
# Triton's generate extension serves any model: the sampler's inputs as top-level keys.
SAMPLER_GENERATE = "/v2/models/sampler/generate"
LOGITS = {"name": "logits", "shape": [1, 4], "datatype": "FP32", "data": [0.5, 2.0, -1.0, 1.5]}
SAMPLER_BODY = {"inputs": [LOGITS]}
GENERATE_BODY = {"input_ids": [5, 6, 7], "max_new_tokens": 4, "top_k": 20, "seed": 1, "return_sampling_mask": True}
CLIENT_ERRORS = tuple(range(400, 500))


def json_body(document) -> bytes:
    """`document` as a request body the way Python clients send it (json.dumps: every non-ASCII
    character becomes a \\u escape)."""
    return json.dumps(document).encode()


@dataclass(frozen=True)
class Probe:
    """One request and the statuses that are right for it (`want`, described by `expect`)."""

    group: str
    expect: str
    want: tuple[int, ...]
    method: str
    path: str
    body: bytes | None = None
    with_key: bool = False


def _group(
    group: str, expect: str, want: tuple[int, ...], requests: list[tuple], with_key: bool = False
) -> list[Probe]:
    return [Probe(group, expect, want, *request, with_key=with_key) for request in requests]


def probes() -> list[Probe]:
    """Every probe, grouped by what it checks."""
    return [
        *_group(
            "valid request",
            "200",
            (200,),
            [
                ("POST", SAMPLER, json_body(SAMPLER_BODY)),
                ("POST", GENERATE, json_body(GENERATE_BODY)),
                ("POST", GENERATE_STREAM, json_body({**GENERATE_BODY, "stream": True})),
                ("POST", SAMPLER_GENERATE, json_body({"logits": [0.5, 2.0, -1.0, 1.5], "top_k": 2})),
                ("GET", "/v2"),
                ("GET", "/v2/health/ready"),
                ("GET", "/v2/models/sampler"),
                ("GET", "/v2/models/generate/config"),
                ("GET", "/v2/models/stats"),
            ],
        ),
        *_group(
            "\\u escape in valid JSON",
            "200",
            (200,),
            [
                ("POST", SAMPLER, json_body({"id": "café", **SAMPLER_BODY})),
                (
                    "POST",
                    SAMPLER,
                    b'{"inputs": [{"name": "\\u006cogits", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}',
                ),
                ("POST", GENERATE, json_body({"id": "naïve", **GENERATE_BODY})),
                ("POST", GENERATE_STREAM, json_body({"id": "日本", **GENERATE_BODY, "stream": True})),
            ],
        ),
        *_group(
            "malformed or mistyped body",
            "400",
            (400,),
            [
                *[
                    ("POST", path, body)
                    for path in (SAMPLER, GENERATE, GENERATE_STREAM, SAMPLER_GENERATE)
                    for body in (b"", b"0", b"[]", b"{", b'{"inputs": 0}', b"\xff\xfe{}")
                ],
                ("POST", SAMPLER, b'{"inputs": []}'),
                ("POST", SAMPLER, b'{"inputs": [{"name": "logits"}]}'),
                ("POST", SAMPLER, json_body({"inputs": [{**LOGITS, "data": [1, 2, 3]}]})),
                ("POST", SAMPLER, json_body({"inputs": [{**LOGITS, "data": ["a", "b", "c", "d"]}]})),
                ("POST", SAMPLER, json_body({"inputs": [{**LOGITS, "datatype": "FP99"}]})),
                # parameters tritonserver reads with a type, names it truncates, numbers past a double
                (
                    "POST",
                    SAMPLER,
                    json_body(
                        {**SAMPLER_BODY, "outputs": [{"name": "output_ids", "parameters": {"binary_data": "yes"}}]}
                    ),
                ),
                ("POST", SAMPLER, json_body({**SAMPLER_BODY, "parameters": {"priority": -1}})),
                ("POST", SAMPLER, json_body({**SAMPLER_BODY, "parameters": {"a\u0000b": 1}})),
                (
                    "POST",
                    SAMPLER,
                    b'{"inputs": [{"name": "logits", "shape": [1, 1], "datatype": "FP32", "data": [1e400]}]}',
                ),
                ("POST", GENERATE, b"{}"),
                ("POST", GENERATE, json_body({"input_ids": "5", "max_new_tokens": 1})),
                ("POST", GENERATE, json_body({"input_ids": [5], "max_new_tokens": "1"})),
                ("POST", GENERATE, json_body({"input_ids": [], "max_new_tokens": 1})),
                ("POST", GENERATE, json_body({"input_ids": [5], "max_new_tokens": 1, "top_p": 2.0})),
                (
                    "POST",
                    GENERATE_STREAM,
                    json_body({"input_ids": [5], "max_new_tokens": 1, "top_k": 0, "stream": True}),
                ),
            ],
        ),
        *_group(
            "request the model cannot serve this way",
            "4xx",
            CLIENT_ERRORS,
            [
                ("POST", GENERATE, json_body({**GENERATE_BODY, "stream": True})),
                (
                    "POST",
                    "/v2/models/generate/infer",
                    json_body({"inputs": [{"name": "input_ids", "shape": [1, 1], "datatype": "INT32", "data": [5]}]}),
                ),
            ],
        ),
        *_group(
            "unknown path",
            "404",
            (404,),
            [
                ("GET", "/"),
                ("GET", "/favicon.ico"),
                ("GET", "/v1/models"),
                ("GET", "/v2/nope"),
                ("GET", "/v2/health"),
                ("GET", "/v2/models/sampler/nope"),
                ("POST", "/v2/models/sampler/versions/1/nope", b"{}"),
                ("POST", "/v2/models/sampler/infer/more", json_body(SAMPLER_BODY)),
                ("GET", "/metrics"),
            ],
        ),
        *_group(
            "unknown model",
            "400 or 404",
            (400, 404),
            [
                ("GET", "/v2/models/nosuchmodel"),
                ("GET", "/v2/models/nosuchmodel/ready"),
                ("POST", "/v2/models/nosuchmodel/infer", json_body(SAMPLER_BODY)),
                ("POST", "/v2/models/nosuchmodel/generate", json_body(GENERATE_BODY)),
            ],
        ),
        *_group(
            "wrong method",
            "405",
            (405,),
            [
                ("DELETE", "/v2/health/ready"),
                ("POST", "/v2/health/live", b"{}"),
                ("PATCH", "/v2", b"{}"),
                ("PUT", "/v2/models/sampler", b"{}"),
                ("GET", SAMPLER),
                ("PUT", SAMPLER, json_body(SAMPLER_BODY)),
                ("GET", GENERATE),
                ("DELETE", GENERATE_STREAM),
            ],
        ),
        *_group(
            "wrong method with the key",
            "405",
            (405,),
            [("GET", "/v2/repository/index"), ("DELETE", "/v2/systemsharedmemory/status")],
            with_key=True,
        ),
        *_group(
            "admin route without the key",
            "403",
            (403,),
            [
                ("POST", "/v2/repository/index", b"{}"),
                ("POST", "/v2/repository/models/sampler/load", b"{}"),
                ("POST", "/v2/repository/models/sampler/unload", b"{}"),
                ("GET", "/v2/systemsharedmemory/status"),
                (
                    "POST",
                    "/v2/systemsharedmemory/region/r0/register",
                    json_body({"key": "r0", "offset": 0, "byte_size": 8}),
                ),
                ("POST", "/v2/systemsharedmemory/unregister"),
                ("GET", "/v2/cudasharedmemory/status"),
                ("GET", "/v2/logging"),
                ("POST", "/v2/logging", json_body({"log_verbose_level": 1})),
                ("GET", "/v2/trace/setting"),
                ("GET", "/v2/models/sampler/trace/setting"),
            ],
        ),
        *_group(
            "path trick toward an admin route without the key",
            "403 or 404",
            (403, 404),
            [
                ("GET", "//v2/logging"),
                ("GET", "/v2/logging/"),
                ("GET", "/v2/%6Cogging"),
                ("GET", "/v2/./logging"),
                ("GET", "/v2/models/sampler/../../logging"),
                ("GET", "/v2/logging?x=1"),
                ("GET", "/v2/logging;x"),
                ("POST", "/v2/models/sampler/%2e%2e/%2e%2e/repository/index", b"{}"),
            ],
        ),
        *_group(
            "admin route with the key",
            "200",
            (200,),
            [("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/logging"), ("POST", "/v2/repository/index", b"{}")],
            with_key=True,
        ),
    ]


def run_probes(port: int, admin_header: str, admin_key: str, tally: Tally) -> None:
    """Send every probe to 127.0.0.1:`port`; record each answer's failures under its group."""
    for probe in probes():
        headers = {"Content-Type": "application/json"} if probe.body else {}
        if probe.with_key:
            headers[admin_header] = admin_key
        answer = send(port, probe.method, probe.path, probe.body, headers)
        failures = answer_failures(answer)
        # a 5xx is its own failure class already
        if answer.status is not None and answer.status < 500 and answer.status not in probe.want:
            failures.append(
                Failure(
                    f"{probe.group}: want {probe.expect}, got {answer.status}",
                    answer.body[:100].decode(errors="replace"),
                )
            )
        notes = []
        if answer.status == 405 and "allow" not in answer.headers:
            notes.append(Failure("405 without an Allow header (RFC 9110 15.5.6)"))
        reproducer = curl_line(probe.method, probe.path, probe.body, headers, admin_key)
        tally.record(f"{probe.group} (want {probe.expect})", answer.status, failures, reproducer, notes)
