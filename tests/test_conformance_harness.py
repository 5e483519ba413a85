"""The conformance harness's own parts, without a server: the strict JSON reader refuses what
strict parsers refuse and reads what json.dumps(allow_nan=False) writes, the answer checks sort
defects into their classes, the request-head fuzz repeats itself and its reproducers send the same
bytes, and bench/conformance/openapi_v2.yaml names exactly the routes the front door lets through
without the admin key (read from the HAProxy config the launcher generates)."""

from __future__ import annotations

import functools
import json
import math
import re
import shlex
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.conformance import request_line
from bench.conformance.checks import Answer, answer_failures
from bench.conformance.strict_json import StrictJsonError, sse_data, strict_loads
from triton_sampling_mask.ops.proxy import TEMPLATE, FrontDoor

REPO_ROOT = Path(__file__).resolve().parent.parent
SPEC = REPO_ROOT / "bench" / "conformance" / "openapi_v2.yaml"
JSON = {"content-type": "application/json"}

finite_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(deadline=None)  # a loaded machine stretches single examples; the count bounds the time
@given(finite_json)
def test_strict_reader_reads_what_a_strict_writer_writes(document):
    for text in (json.dumps(document, allow_nan=False), json.dumps(document, allow_nan=False, ensure_ascii=False)):
        assert strict_loads(text.encode()) == document


@settings(deadline=None)
@given(finite_json, st.sampled_from([math.inf, -math.inf, math.nan]))
def test_strict_reader_refuses_any_non_finite_number_anywhere(document, bad):
    # Python's json writes NaN/Infinity/-Infinity by default; no strict parser reads them
    text = json.dumps({"doc": document, "bad": [1.0, bad]})
    with pytest.raises(StrictJsonError) as error:
        strict_loads(text)
    assert error.value.kind == json.dumps(bad)


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (b'{"a": -Infinity}', "-Infinity"),
        (b"[NaN]", "NaN"),
        (b"Infinity", "Infinity"),
        (b"[1e400]", "number beyond float64"),
        (b'{"error":"\\u escapes are not accepted"}', "syntax error"),  # an unescaped backslash pasted into JSON
        (b'{"a": 1,}', "syntax error"),
        (b"", "syntax error"),
        (b'{"a": "\xff"}', "not UTF-8"),
    ],
)
def test_strict_reader_names_each_defect(body, kind):
    with pytest.raises(StrictJsonError) as error:
        strict_loads(body)
    assert error.value.kind == kind


def test_strict_reader_accepts_escapes_and_big_integers():
    assert strict_loads(b'{"caf\\u00e9": [18446744073709551615, -1.5e-300, "\\ud83d\\ude00"]}') == {
        "café": [2**64 - 1, -1.5e-300, "\U0001f600"]
    }


def test_server_sent_events_are_split_into_their_data():
    body = b'data: {"a": 1}\n\ndata: {"b":\r\ndata: 2}\r\n\r\n: comment\n\ndata: [3]'
    assert [json.loads(event) for event in sse_data(body)] == [{"a": 1}, {"b": 2}, [3]]


@pytest.mark.parametrize(
    ("answer", "kinds"),
    [
        (Answer(200, JSON, b'{"outputs": [{"data": [0.5, 1]}]}'), []),
        (Answer(400, JSON, b'{"error": "top_k must be >= 1"}'), []),
        (Answer(200, {}, b""), []),
        (Answer(200, JSON, b'{"data": [-Infinity]}'), ["answer not strict JSON: -Infinity"]),
        (
            Answer(500, JSON, b'{"error": "failed to parse"}'),
            ["server error 500"],
        ),
        (
            Answer(400, {"content-type": "text/html"}, b"<html>400</html>"),
            ["error answer is text/html, not application/json"],
        ),
        (Answer(403, {}, b""), ["error answer is untyped, not application/json"]),
        (Answer(400, JSON, b'{"message": "x"}'), ['error answer without an "error" string']),
        (Answer(200, JSON, b'{"error": "one response only"}'), ["error carried by a 200"]),
        (Answer(200, JSON, b""), ["empty answer labelled JSON"]),
        (
            Answer(200, {"content-type": "text/event-stream"}, b'data: {"a": 1}\n\ndata: {"b": NaN}\n\n'),
            ["event not strict JSON: NaN"],
        ),
        (Answer(None, error="ConnectionResetError"), ["no answer"]),
    ],
)
def test_answer_checks_sort_defects_into_classes(answer, kinds):
    assert [failure.kind for failure in answer_failures(answer)] == kinds


def test_request_head_fuzz_repeats_and_its_reproducers_send_the_same_bytes():
    first, again = request_line.generate(300, seed=5), request_line.generate(300, seed=5)
    assert [r.render() for r in first] == [r.render() for r in again]
    assert len({r.render() for r in first}) > 200  # varied
    for raw in (r.render() for r in first):
        assert raw != request_line.RawRequest(b"GET", b"/v2/health/ready").render()
        code = shlex.split(request_line.reproducer(raw))[2]
        sent = re.search(r"s\.sendall\((.*)\); print", code).group(1)
        assert eval(sent) == raw  # noqa: S307 - our own expression, checked to be bytes


# ---- the spec against the front door's allow-list ----


def expanded(template: str, environment: dict[str, str]) -> str:
    """The template as HAProxy reads it with `environment`: `.if defined(...)` blocks decided and
    "${NAME}" replaced."""
    lines, keep = [], [True]
    for line in template.splitlines():
        directive = line.strip()
        if directive.startswith(".if defined("):
            keep.append(keep[-1] and directive.removeprefix(".if defined(").rstrip(")") in environment)
        elif directive == ".else":
            keep[-1] = not keep[-1] and keep[-2]
        elif directive == ".endif":
            keep.pop()
        elif keep[-1] and not directive.startswith("."):
            lines.append(re.sub(r"\$\{(\w+)\}", lambda match: environment.get(match[1], match[0]), line))
    return "\n".join(lines) + "\n"


def _http_frontend(config: str) -> list[str]:
    section = config.split("frontend fe_http\n", 1)[1]
    return section.split("\nfrontend ", 1)[0].split("\nbackend ", 1)[0].splitlines()


class FrontDoorRules:
    """The HTTP front end's routing as HAProxy applies it to a request without the admin key and
    with a clean head and body: acls on the method and the path, boolean variables, and the first
    deny or return rule whose condition holds. Any other condition (headers, the body, queues, the
    key file) is false for such a request."""

    def __init__(self, config: str):
        self.acls = defaultdict(list)
        self.rules = []  # ("set", variable, if/unless, condition) or ("stop", status, if/unless, condition)
        for line in _http_frontend(config):
            line = re.sub(r'"(?:\\.|[^"\\])*"', '""', line.strip())  # messages may hold any word
            if match := re.match(r"acl (\S+) (\S+) ?(.*)$", line):
                self.acls[match[1]].append((match[2], match[3]))
            elif match := re.match(r"http-request set-var\(txn\.(\w+)\) bool\(true\) (if|unless) (.+)$", line):
                self.rules.append(("set", match[1], match[2], match[3]))
            elif match := re.match(
                r"http-request (?:deny deny_status|return status) (\d+)(?:.* (if|unless) (.+))?$", line
            ):
                self.rules.append(("stop", int(match[1]), match[2] or "unless", match[3] or "{ never }"))

    def _term(self, term: str, method: str, path: str, variables: dict) -> bool:
        if term.startswith("!"):
            return not self._term(term[1:], method, path, variables)
        if match := re.fullmatch(r"\{ var\(txn\.(\w+)\) -m (bool|found) \}", term):
            return bool(variables.get(match[1]))
        if match := re.fullmatch(r"\{ (method|path|path_reg|path_beg) (.+) \}", term):
            return self._holds([(match[1], match[2])], method, path)
        return self._holds(self.acls.get(term, []), method, path)

    @staticmethod
    def _holds(definitions, method: str, path: str) -> bool:
        for kind, value in definitions:
            if (
                (kind == "method" and method in value.split())
                or (kind == "path" and path in value.split())
                or (kind == "path_beg" and path.startswith(tuple(value.split())))
                or (kind == "path_reg" and re.search(value, path))
                or kind == "always_true"
            ):
                return True
        return False

    def _condition(self, condition: str, method: str, path: str, variables: dict) -> bool:
        alternatives = re.split(r"\s+(?:or|\|\|)\s+", condition)
        return any(
            all(self._term(term, method, path, variables) for term in re.findall(r"!?\{[^}]*\}|\S+", alternative))
            for alternative in alternatives
        )

    def stop(self, method: str, path: str) -> int | None:
        """The status of the first deny or return that `method path` meets; None: it reaches a backend."""
        variables = {}
        for action, target, mode, condition in self.rules:
            holds = self._condition(condition, method, path, variables) == (mode == "if")
            if holds and action == "set":
                variables[target] = True
            elif holds:
                return target
        return None

    def literal_paths(self) -> set[str]:
        """Every path an acl names literally."""
        return {p for definitions in self.acls.values() for kind, v in definitions if kind == "path" for p in v.split()}


@functools.cache
def spec_operations() -> list[tuple[str, str, bool]]:
    """(METHOD, path template, admin) of every operation in the spec."""
    paths = yaml.safe_load(SPEC.read_text())["paths"]
    return [
        (method.upper(), template, bool(operation.get("security")))
        for template, item in paths.items()
        for method, operation in item.items()
        if method in ("get", "post", "put", "delete", "patch", "head")
    ]


def _template_regex(template: str) -> str:
    return "^" + re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", re.escape(template)) + "$"


def spec_allows_publicly(method: str, path: str) -> bool:
    return any(m == method and not admin and re.match(_template_regex(t), path) for m, t, admin in spec_operations())


def _concrete(template: str, model: str = "sampler") -> str:
    return template.replace("{model_name}", model).replace("{model_version}", "1").replace("{region_name}", "r0")


def candidate_requests() -> set[tuple[str, str]]:
    """Every spec operation made concrete, and the route shapes the proxy's rules speak of."""
    candidates = {
        (m, _concrete(t, model)) for m, t, _ in spec_operations() for model in ("sampler", "generate", "other")
    }
    suffixes = ("", "/ready", "/config", "/stats", "/infer", "/generate", "/generate_stream", "/trace/setting", "/nope")
    for model in ("sampler", "generate", "other"):
        for version in ("", "/versions/1"):
            for suffix in suffixes:
                candidates |= {(method, f"/v2/models/{model}{version}{suffix}") for method in ("GET", "POST")}
    literal = "/v2 /v2/health/live /v2/health/ready /v2/models/stats /v2/logging /v2/repository/index /metrics /"
    candidates |= {(method, path) for path in literal.split() for method in ("GET", "POST")}
    return candidates


@pytest.fixture(scope="module")
def front_door(tmp_path_factory) -> FrontDoorRules:
    internal = {"http": 19000, "grpc": 19001, "metrics": 19002, "probe": 19003, "stream_gate": 19004}
    door = FrontDoor(REPO_ROOT / "model_repository", {"http": 18000, "grpc": 18001}, "key", internal)
    door.directory = tmp_path_factory.mktemp("door")
    rules = FrontDoorRules(expanded(TEMPLATE.read_text(), door.environment()))
    assert rules.stop("GET", "/v2/health/ready") is None and rules.stop("GET", "/v2/logging") == 403
    return rules


def test_the_spec_names_every_route_the_proxy_lets_through_without_the_key(front_door):
    unnamed = [
        (method, path)
        for method, path in sorted(candidate_requests())
        if front_door.stop(method, path) is None and not spec_allows_publicly(method, path)
    ]
    assert not unnamed, f"let through without the key, but no public operation of the spec: {unnamed}"
    # a literal public path is in the spec as itself, not only as a model named like it ("stats")
    literals = {path for path in front_door.literal_paths() if front_door.stop("GET", path) is None}
    assert literals and literals <= {template for _, template, admin in spec_operations() if not admin}


def test_the_proxy_lets_through_every_public_route_of_the_spec(front_door):
    # POSTs to a model named by a parameter are exempt: a model the repository does not hold may
    # be refused at the door (with a 4xx) rather than by tritonserver
    required = {
        (method, _concrete(template, model))
        for method, template, admin in spec_operations()
        if not admin and not (method == "POST" and "{model_name}" in template)
        for model in ("sampler", "generate")
    }
    # the door answers /infer on the decoupled model itself: a 400 in place of tritonserver's 501
    required = {(m, p) for m, p in required if not (p.startswith("/v2/models/generate/") and p.endswith("/infer"))}
    refused = {(m, p): front_door.stop(m, p) for m, p in sorted(required) if front_door.stop(m, p) is not None}
    assert not refused, f"public operations of the spec the proxy refuses without the key: {refused}"


def test_every_admin_operation_of_the_spec_is_refused_without_the_key(front_door):
    admin = [(m, _concrete(t)) for m, t, is_admin in spec_operations() if is_admin]
    families = ("/v2/repository/", "/v2/systemsharedmemory/", "/v2/cudasharedmemory/", "/v2/logging", "/trace/setting")
    assert all(any(family in path for _, path in admin) for family in families)
    assert {(m, p): front_door.stop(m, p) for m, p in admin if front_door.stop(m, p) != 403} == {}


def test_the_spec_loads_in_schemathesis_and_every_operation_is_fuzzed():
    schema_fuzz = pytest.importorskip("bench.conformance.schema_fuzz", reason="schemathesis (the conformance extra)")
    operations = schema_fuzz.load_operations(SPEC)
    assert len(operations) == len(spec_operations())
    runs = schema_fuzz.fuzz_runs(operations)
    assert {run.operation.label for run in runs} == {op.label for op in operations}
    assert all(
        run.admin
        == (
            run.operation.path.startswith(("/v2/repository", "/v2/system", "/v2/cuda", "/v2/logging", "/v2/trace"))
            or run.operation.path.endswith("/trace/setting")
        )
        for run in runs
    )
