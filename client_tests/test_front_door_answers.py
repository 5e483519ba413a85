"""What the front door answers: JSON a client in any language can parse, 4xx for client errors.

Against the session's fronted server (conftest.py), over raw sockets so that a request can carry
what no well-behaved client sends (two copies of a header, a malformed length). tritonserver 2.51
answers a malformed or wrongly typed body with a 500, reads a shape before its data, streams on
`/generate` into a 200 carrying an error, and answers unknown routes in text/plain: each case
below is one it got wrong without the proxy's strict checks.
"""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from testbed.fronted import FrontedTritonServer
from triton_sampling_mask.ops.proxy import find_haproxy

SAMPLER = "/v2/models/sampler/infer"
GENERATE = "/v2/models/generate/generate"
LOGITS_4 = {"name": "logits", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}


@pytest.fixture(scope="module")
def port(triton_server) -> int:
    if find_haproxy() is None or not isinstance(triton_server, FrontedTritonServer):
        pytest.skip("no front door here (haproxy missing, or an external server)")
    return triton_server.ports["http"]


def send(port: int, method: str, path: str, body: bytes = b"", headers: list[tuple[str, str]] | None = None):
    """(status, content type, body text) of one request written byte for byte; `headers` may
    repeat a name. Content-Length is added unless `headers` names it."""
    headers = list(headers or [])
    if not any(name.lower() == "content-length" for name, _ in headers):
        headers.append(("Content-Length", str(len(body))))
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        return response.status, response.getheader("content-type", ""), response.read().decode(errors="replace")


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def error_of(answer) -> str:
    """The message of a JSON error answer (asserting it is one)."""
    status, content_type, text = answer
    assert content_type.startswith("application/json"), answer
    return strict_json(text)["error"]


@pytest.mark.parametrize(
    "body, says",
    [
        (b"", "not valid JSON"),
        (b"0", "JSON object"),
        (b'{"inputs": []}', "non-empty list"),
        (b'{"inputs": 5}', "non-empty list"),
        (b'{"inputs": [5]}', "must be an object"),
        (b'{"inputs": [{"name": "logits", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, "x"]}]}', "FP32"),
        (b'{"inputs": [{"name": "logits", "shape": [1, 4.5], "datatype": "FP32", "data": [1]}]}', "shape"),
        (b'{"inputs": [{"name": "logits", "shape": [1, 1099511627776], "datatype": "FP32", "data": [1]}]}', "shape"),
        (b'{"inputs": [{"name": "logits", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3]]}]}', "nests"),
        (b'{"inputs": [], "inputs": []}', "duplicate key"),
        (b'{"inputs": [{"name": "logits", "shape": [1], "datatype": "FP32", "data": [1]}], "extra": 1}', "extra"),
        (b'{"inputs": [{"name": "\xff", "shape": [1], "datatype": "FP32", "data": [1]}]}', "UTF-8"),
        (b"[" * 40 + b"]" * 40, "levels deep"),
        # numbers past a double: tritonserver's JSON parser answers them with a 500, wherever they are
        (b'{"inputs": [{"name": "logits", "shape": [1, 2], "datatype": "FP32", "data": [1e400, 2]}]}', "too large"),
        (b'{"inputs": [], "parameters": {"x": -1e400}}', "a number too large for a double at byte 35"),
        (
            b'{"inputs": [{"name": "logits", "shape": [1, 1], "datatype": "FP32", "data": [1%s]}]}' % (b"0" * 400),
            "large",
        ),
    ],
)
def test_a_malformed_or_wrongly_typed_infer_body_is_a_400_naming_the_problem(port, body, says):
    answer = send(port, "POST", SAMPLER, body)
    assert answer[0] == 400, answer
    assert says in error_of(answer)


def with_parameters(request=None, logits=None, output=None, output_name="output_ids") -> bytes:
    """A sampler /infer body whose request, logits input and one requested output carry these parameters."""
    body = {"inputs": [{**LOGITS_4, **({"parameters": logits} if logits else {})}]}
    if request:
        body["parameters"] = request
    if output:
        body["outputs"] = [{"name": output_name, "parameters": output}]
    return json.dumps(body).encode()


# Parameters tritonserver's HTTP frontend reads with a type: each wrongly typed one was its 500.
@pytest.mark.parametrize(
    "body, says",
    [
        (
            with_parameters(output={"binary_data": "yes"}),
            "output 'output_ids': parameter 'binary_data' must be a boolean",
        ),
        (with_parameters(output={"binary_data": 1}, output_name="nope"), "output 'nope': parameter 'binary_data'"),
        (with_parameters(output={"classification": -1}), "parameter 'classification' must be a non-negative integer"),
        (with_parameters(output={"classification": 2.5}), "'classification'"),
        (with_parameters(output={"shared_memory_region": 5, "shared_memory_byte_size": 8}), "'shared_memory_region'"),
        (with_parameters(output={"shared_memory_byte_size": "8"}), "'shared_memory_byte_size'"),
        (with_parameters(output={"shared_memory_offset": -1}), "'shared_memory_offset'"),
        (with_parameters(request={"binary_data_output": 1}), "the request: parameter 'binary_data_output'"),
        (with_parameters(request={"sequence_start": "yes"}), "'sequence_start' must be a boolean"),
        (with_parameters(request={"sequence_end": 0}), "'sequence_end' must be a boolean"),
        (with_parameters(request={"priority": -1}), "'priority' must be a non-negative integer"),
        (with_parameters(request={"timeout": 1.5}), "'timeout'"),
        (with_parameters(request={"sequence_id": 1.5}), "'sequence_id' must be a string or a non-negative integer"),
        (with_parameters(request={"sequence_id": True}), "'sequence_id'"),
        (with_parameters(request={"sequence_id": 2**64}), "'sequence_id'"),
        (with_parameters(logits={"shared_memory_offset": "0"}), "input 'logits': parameter 'shared_memory_offset'"),
        (
            with_parameters(logits={"shared_memory_byte_size": "16"}),
            "input 'logits': parameter 'shared_memory_byte_size'",
        ),
        (with_parameters(request={"a\u0000b": 1}), "the request: a parameter's name may not hold a NUL character"),
    ],
)
def test_a_wrongly_typed_parameter_tritonserver_reads_is_a_400_naming_it(port, body, says):
    answer = send(port, "POST", SAMPLER, body)
    assert answer[0] == 400, answer
    assert says in error_of(answer)


@pytest.mark.parametrize(
    "body",
    [
        with_parameters(output={"binary_data": False, "classification": 0}),
        with_parameters(output={"classification": 2}),
        with_parameters(
            request={"sequence_id": "abc", "priority": 0, "timeout": 2**63 + 5, "binary_data_output": False}
        ),
        with_parameters(request={"sequence_id": 2**64 - 1, "sequence_start": False, "sequence_end": False}),
        with_parameters(request={"anything": "else"}, output={"unread": 1.5}, logits={"unread": True}),
    ],
)
def test_parameters_of_the_types_tritonserver_reads_pass(port, body):
    status, _, text = send(port, "POST", SAMPLER, body)
    assert status == 200, text


@pytest.mark.parametrize(
    "body, says",
    [
        (b"", "not valid JSON"),
        (b"0", "JSON object"),
        (b'{"input_ids": "abc", "max_new_tokens": 2}', "INT32"),
        (b'{"input_ids": [1, 2], "max_new_tokens": 2, "temperature": "hot"}', "FP32"),
        (b'{"input_ids": [1, 2], "max_tokens": 2}', "unknown field 'max_tokens'"),
        (b'{"input_ids": [1, 2], "max_new_tokens": 2, "temperature": 1e309}', "a number too large for a double"),
        (b'{"input_ids": [1, 2], "max_new_tokens": 2, "stream": true}', "generate_stream"),
    ],
)
def test_a_bad_generate_body_is_a_400_naming_the_problem(port, body, says):
    answer = send(port, "POST", GENERATE, body)
    assert answer[0] == 400, answer
    assert says in error_of(answer)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"0",
        b'{"logits": "abc"}',
        b'{"logits": [1, 2], "top_k": 1.5}',
        b'{"logits": [1], "parameters": {"\\u0000": 1}}',
    ],
)
def test_the_generate_extension_on_the_sampler_is_checked_too(port, body):
    """The sampler is not decoupled, but tritonserver serves the generate extension on it too."""
    answer = send(port, "POST", "/v2/models/sampler/generate", body)
    assert answer[0] == 400, answer
    error_of(answer)


def test_escapes_are_decoded_not_refused(port):
    """Python's json.dumps writes \\u escapes for every non-ASCII character: they are JSON."""
    body = json.dumps({"id": "r\u00e9sum\u00e9 \U0001f600", "inputs": [LOGITS_4]}).encode()
    assert b"\\u" in body
    status, _, text = send(port, "POST", SAMPLER, body)
    assert status == 200, text
    assert strict_json(text)["id"] == "r\u00e9sum\u00e9 \U0001f600"
    # An escaped key is the key it spells: the shape check still sees it.
    sneaky = b'{"inputs": [{"name": "logits", "\\u0073hape": [1, 1099511627776], "datatype": "FP32", "data": [1]}]}'
    answer = send(port, "POST", SAMPLER, sneaky)
    assert answer[0] == 400 and "shape" in error_of(answer)


def test_a_check_error_message_is_escaped_json(port):
    answer = send(port, "POST", GENERATE, b'{"input_ids": [1], "max_new_tokens": 1, "a\\"b\\\\c": 1}')
    assert answer[0] == 400 and 'a"b\\c' in error_of(answer)


def test_answers_carry_no_infinity(port):
    body = json.dumps({"inputs": [LOGITS_4]}).encode()
    status, _, text = send(port, "POST", SAMPLER, body)
    assert status == 200 and "Infinity" not in text and "NaN" not in text
    strict_json(text)
    body = json.dumps({"input_ids": [1, 2], "max_new_tokens": 2, "top_k": 3, "return_sampling_mask": True}).encode()
    status, _, text = send(port, "POST", GENERATE, body)
    assert status == 200 and "Infinity" not in text
    assert len(strict_json(text)["sampling_mask_logprobs"]) > 3


@pytest.mark.parametrize(
    "method, path, status",
    [
        ("GET", "/v2/no-such-route", 404),
        ("GET", "/", 404),
        ("POST", "/v2/models/sampler/explode", 404),
        ("DELETE", "/v2/health/ready", 405),
        ("POST", "/v2/health/live", 405),
        ("GET", SAMPLER, 405),
        ("PUT", GENERATE, 405),
    ],
)
def test_unknown_routes_are_404_and_wrong_methods_405_in_json(port, method, path, status):
    answer = send(port, method, path)
    assert answer[0] == status, answer
    error_of(answer)


def test_infer_on_the_decoupled_model_is_a_400_not_a_501(port):
    body = json.dumps({"inputs": [{"name": "input_ids", "shape": [1, 1], "datatype": "INT32", "data": [5]}]})
    answer = send(port, "POST", "/v2/models/generate/infer", body.encode())
    assert answer[0] == 400 and "generate_stream" in error_of(answer)


def test_a_refused_stream_is_a_4xx_whose_event_is_a_json_error(port):
    """tritonserver answers generate_stream as server-sent events, refusals included: the status
    is the 400, and the one event's data a strict JSON error an SSE client reads."""
    status, content_type, text = send(
        port, "POST", "/v2/models/generate/generate_stream", b'{"input_ids": [-1], "max_new_tokens": 1}'
    )
    assert status == 400 and content_type.startswith("text/event-stream"), (status, content_type, text)
    [event] = [line[len("data:") :] for line in text.splitlines() if line.startswith("data:")]
    assert "input_ids" in strict_json(event)["error"]


def test_a_head_larger_than_tritonserver_takes_is_a_431(port):
    answer = send(port, "GET", "/v2/health/ready", headers=[("X-Filler", "f" * 20000)])
    assert answer[0] == 431, answer
    error_of(answer)


def test_tritonservers_own_errors_are_labelled_json(port):
    """tritonserver answers an unknown model in text/plain; the proxy labels its JSON."""
    answer = send(port, "GET", "/v2/models/no_such_model/config")
    assert answer[0] >= 400
    assert "no_such_model" in error_of(answer)


def test_a_signed_length_is_refused_by_haproxys_own_parser(port):
    """HAProxy 2.6's HTTP/1 parser refuses it before any rule runs, with its built-in HTML 400 (no
    errorfile applies there): refused all the same (docs/operations.md lists it)."""
    answer = send(port, "POST", SAMPLER, b"{}", [("Content-Length", "+2")])
    assert answer[0] == 400, answer


@pytest.mark.parametrize(
    "headers, says",
    [
        ([("Content-Length", "18446744073709551615")], "Content-Length"),
        ([("Inference-Header-Content-Length", "1.5")], "Inference-Header-Content-Length"),
        ([("Inference-Header-Content-Length", "2"), ("Inference-Header-Content-Length", "9")], "Inference-Header"),
        ([("triton-admin-key", "a"), ("triton-admin-key", "b")], "triton-admin-key"),
    ],
)
def test_framing_headers_are_read_strictly(port, headers, says):
    answer = send(port, "POST", SAMPLER, json.dumps({"inputs": [LOGITS_4]}).encode(), headers)
    assert answer[0] == 400, answer
    assert says in error_of(answer)


@pytest.mark.parametrize(
    "connection", ["", "Connection: close\r\n", "Connection: keep-alive\r\n"], ids=["bare", "close", "keep-alive"]
)
@pytest.mark.parametrize("path", ["/v2/health/ready", "/v2/health/live", "/v2/models/sampler/ready"])
def test_an_http_1_0_readiness_check_gets_a_whole_answer(port, path, connection):
    """nginx (proxy_http_version 1.0 by default), HAProxy's httpchk and ab send HTTP/1.0. tritonserver
    answers an empty 200 without a length on a kept-alive connection, so through a door that kept
    its server connection alive the answer never ended: the client waited out the server timeout."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\n{connection}\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):  # to the end of the answer: without the fix, a timeout
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and body == b"", answer
