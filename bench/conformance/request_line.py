"""Malformed HTTP/1.1 request heads over raw sockets: a valid request with one or two mutations
(odd methods, targets and versions, bare line ends, control and high bytes, broken or conflicting
headers, smuggling framings, oversized parts), drawn from a seeded generator so a run repeats.

Each answer must not be a 5xx (but 501 for an unknown method and 505 for an unsupported version,
which RFC 9110 prescribes), must follow `checks.answer_failures` otherwise, and a target naming an
admin route must never be answered 2xx without the key. Closing without an answer, or not
answering within the read timeout, is noted, not failed: for garbage either is a defensible end."""

from __future__ import annotations

import http.client
import random
import shlex
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .checks import Answer, Failure, answer_failures
from .probes import SAMPLER_BODY, json_body
from .tally import Tally

OPERATION = "raw request head"
# The statuses the RFC prescribes for some of these mutations.
PRESCRIBED_5XX = {501, 505}
ADMIN_WORDS = (b"logging", b"repository", b"sharedmemory", b"trace")
ODD_METHODS = [b"get", b"G\x00ET", b"", b"PRI", b"CONNECT", b"TRACE", b"BREW", b"GET GET", b"P" * 300, b"\xc3\x89T"]
ODD_TARGETS = [
    b"*",
    b"v2/health/ready",
    b"http://127.0.0.1/v2/health/ready",
    b"http://evil.example/v2/logging",
    b"/v2/health/ready#frag",
    b"/%",
    b"/%zz",
    b"/\x7f",
    b"/\xff",
    b"/v2/models/sampler/infer\x00",
    b"/v2/logging\x00/v2/health/ready",
    b"/v2/health/ready /v2/logging",
    b"/" + b"a" * 20000,
    b"",
]
ODD_VERSIONS = [
    b"HTTP/1.0",
    b"HTTP/2.0",
    b"HTTP/9.9",
    b"HTTP/1.1x",
    b"http/1.1",
    b"",
    b"HTTP/01.1",
    b"HTTP/1",
    b"HTTP/1.1 extra",
]
ODD_HEADERS = [
    b"NoColon",
    b" Leading: space",
    b"Bad Name: x",
    b"Bad\x01Name: x",
    b"X-Nul: a\x00b",
    b"X-High: \xff\xfe",
    b"Content-Length: -1",
    b"Content-Length: abc",
    b"Content-Length: 1, 2",
    b"Content-Length: 99999999999999999999",
    b"Content-Length : 0",
    b"Transfer-Encoding: xchunked",
    b"Transfer-Encoding: chunked",
    b"Content-Encoding: gzip",
    b"X-Fold: a\r\n b",
    b"Host: a\r\nHost: b",
    b"Expect: 100-continue",
    b"triton-admin-key: wrong",
    b"Inference-Header-Content-Length: -5",
    b"Inference-Header-Content-Length: 999999",
    b"X-Long: " + b"x" * 70000,
]


@dataclass
class RawRequest:
    """The parts of one request head, the mutations applied to it, and its body."""

    method: bytes
    target: bytes | None  # None: merged into `method` by a mutation of the whole line
    version: bytes | None = b"HTTP/1.1"
    eol: bytes = b"\r\n"
    headers: list[bytes] = field(default_factory=lambda: [b"Host: localhost"])
    body: bytes = b""
    mutations: list[str] = field(default_factory=list)

    def render(self) -> bytes:
        """The bytes sent: the head, a Content-Length for the body unless a mutation set one, the body."""
        headers = list(self.headers)
        if self.body and not any(h.lower().startswith((b"content-length", b"transfer-encoding")) for h in headers):
            headers.append(b"Content-Length: " + str(len(self.body)).encode())
        head = b" ".join(part for part in (self.method, self.target, self.version) if part is not None)
        return head + self.eol + b"".join(h + self.eol for h in headers) + self.eol + self.body


def _base(rng: random.Random) -> RawRequest:
    choice = rng.randrange(4)
    if choice == 0:
        return RawRequest(b"GET", b"/v2/health/ready")
    if choice == 1:
        return RawRequest(b"GET", b"/v2/models/sampler")
    if choice == 2:
        return RawRequest(b"POST", b"/v2/models/sampler/infer", body=json_body(SAMPLER_BODY))
    return RawRequest(b"POST", b"/v2/logging", body=b'{"log_verbose_level": 1}')


def _mutate(rng: random.Random, request: RawRequest) -> None:
    kind = rng.randrange(11)
    if kind == 0:
        request.method = rng.choice(ODD_METHODS)
        request.mutations.append("method")
    elif kind == 1:
        request.target = rng.choice(ODD_TARGETS)
        request.mutations.append("target")
    elif kind == 2:
        request.version = rng.choice(ODD_VERSIONS)
        request.mutations.append("version")
    elif kind == 3:
        request.eol = rng.choice([b"\n", b"\r", b"\n\r"])
        request.mutations.append("line end")
    elif kind in (4, 5):
        request.headers.insert(rng.randrange(len(request.headers) + 1), rng.choice(ODD_HEADERS))
        request.mutations.append("header")
    elif kind == 6:
        request.headers = [h for h in request.headers if not h.startswith(b"Host")]
        request.mutations.append("no Host")
    elif kind == 7:
        line = bytearray(
            b" ".join(part for part in (request.method, request.target, request.version) if part is not None)
        )
        line.insert(rng.randrange(len(line) + 1), rng.choice([0, 1, 9, 11, 12, 13, 27, 127, 128, 255]))
        request.method, request.target, request.version = bytes(line), None, None
        request.mutations.append("byte in request line")
    elif kind == 8:
        # two framings at once: what request smuggling rides on
        request.method, request.target = b"POST", b"/v2/models/sampler/infer"
        smuggled = b"0\r\n\r\nGET /v2/logging HTTP/1.1\r\nHost: localhost\r\n\r\n"
        request.headers += [b"Transfer-Encoding: chunked", f"Content-Length: {len(smuggled)}".encode()]
        request.body = smuggled
        request.mutations.append("TE and CL")
    elif kind == 9:
        request.headers += [
            f"Content-Length: {len(request.body)}".encode(),
            f"Content-Length: {len(request.body) + 1}".encode(),
        ]
        request.mutations.append("two Content-Lengths")
    else:
        request.headers += [f"X-Many-{i}: {i}".encode() for i in range(rng.choice([120, 1200]))]
        request.mutations.append("many headers")


def generate(count: int, seed: int) -> list[RawRequest]:
    """`count` mutated requests, the same for the same seed."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        request = _base(rng)
        for _ in range(rng.choice([1, 1, 2])):
            _mutate(rng, request)
        requests.append(request)
    return requests


def exchange(port: int, raw: bytes, timeout_s: float) -> Answer:
    """Send `raw` on a fresh connection; the parsed answer, or why there was none. An answer whose
    body does not end within the timeout keeps its status and headers, with `error` saying so."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            try:
                sock.sendall(raw)
            except OSError:
                pass  # the proxy may answer and close before reading everything
            response = http.client.HTTPResponse(sock)
            response.begin()
            headers = {name.lower(): value for name, value in response.getheaders()}
            try:
                return Answer(response.status, headers, response.read())
            except (http.client.IncompleteRead, ConnectionError) as error:
                return Answer(response.status, headers, getattr(error, "partial", b""))
            except TimeoutError:
                return Answer(response.status, headers, error=f"body not ended within {timeout_s:.0f} s")
    except TimeoutError:
        return Answer(None, error=f"no answer within {timeout_s:.0f} s")
    except (OSError, http.client.HTTPException) as error:
        return Answer(None, error=f"closed without an answer ({type(error).__name__})")


def _literal(data: bytes) -> str:
    """A double-quoted bytes literal with no single quote in it (it goes inside a shell '...')."""
    escapes = {13: "\\r", 10: "\\n", 9: "\\t", 34: '\\"', 92: "\\\\", 39: "\\x27"}
    return 'b"' + "".join(escapes.get(b) or (chr(b) if 32 <= b < 127 else f"\\x{b:02x}") for b in data) + '"'


def _bytes_expr(data: bytes, run: int = 16) -> str:
    """A short Python expression for `data`: runs of `run` or more of one byte written as b"x" * n."""
    parts, literal, i = [], bytearray(), 0
    while i < len(data):
        j = i
        while j < len(data) and data[j] == data[i]:
            j += 1
        if j - i >= run:
            if literal:
                parts.append(_literal(bytes(literal)))
                literal.clear()
            parts.append(f"{_literal(data[i : i + 1])} * {j - i}")
        else:
            literal += data[i:j]
        i = j
    if literal:
        parts.append(_literal(bytes(literal)))
    return " + ".join(parts) or 'b""'


def reproducer(raw: bytes) -> str:
    """A shell line sending `raw` to `make serve`'s default HTTP port and printing the answer."""
    code = (
        'import socket; s = socket.create_connection(("localhost", 8000)); '
        f"s.sendall({_bytes_expr(raw)}); print(s.recv(65536))"
    )
    return "python3 -c " + shlex.quote(code)


def raw_failures(request: RawRequest, answer: Answer) -> tuple[list[Failure], list[Failure]]:
    """(failures, notes) of one raw request's answer."""
    if answer.status is None:
        return [], [Failure(answer.error.split(" (")[0])]
    notes = []
    checked = answer_failures(answer)
    if answer.error:  # an answer cut short: its status still counts, its body cannot be judged
        notes.append(Failure(answer.error))
        checked = [f for f in checked if f.kind.startswith("server error")]
    failures = [f for f in checked if not (answer.status in PRESCRIBED_5XX and f.kind.startswith("server error"))]
    raw = request.render()
    target = raw.split(b"\n", 1)[0]
    if 200 <= answer.status < 300 and any(word in target for word in ADMIN_WORDS):
        failures.append(
            Failure(f"admin route answered {answer.status} without the key", target[:80].decode(errors="replace"))
        )
    return failures, notes


def run_request_fuzz(port: int, tally: Tally, count: int, seed: int, budget_s: float, timeout_s: float = 3.0) -> int:
    """Send `count` mutated requests (8 at a time, within `budget_s`); record each under its
    mutations. Returns how many were sent."""
    deadline = time.monotonic() + budget_s
    requests = generate(count, seed)

    def one(request: RawRequest):
        if time.monotonic() > deadline:
            return None
        return request, exchange(port, request.render(), timeout_s)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = [result for result in pool.map(one, requests) if result is not None]
    for request, answer in results:
        failures, notes = raw_failures(request, answer)
        operation = f"{OPERATION}: {' + '.join(request.mutations)}"
        tally.record(operation, answer.status, failures, reproducer(request.render()), notes)
    return len(results)
