"""The front door of `make serve`, attacked through the real launcher (supervisor, HAProxy, stream
gate, tritonserver on loopback): the non-destructive attacks of testbed/hostile.py, the admin
surface, the request checks the proxy makes before any byte reaches the server, and the proxy's
own supervision.

HOSTILE_LAUNCHER (a command) and HOSTILE_LAUNCHER_CWD run the attack tests against another
launcher, e.g. one from before the front door (HOSTILE_LAUNCHER_LEGACY=1: it serves the public
ports itself); each attack test must then fail. The stack always runs inside a memory cgroup of
its own where this host can make one; tests that would be destructive without the proxy skip
when it cannot.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from testbed import api_attacks, door_attacks, hostile
from testbed import stack as full_stack
from testbed.server import ExternalTritonServer
from triton_sampling_mask.client import SamplerClient
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.ops.server_process import ADMIN_HEADER, GRPC_ADMIN_HEADER

LEGACY = os.environ.get("HOSTILE_LAUNCHER_LEGACY") == "1"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`sampler` and `generate` behind the launcher's front door, on free ports."""
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("attacks the launcher's own front door: needs a local launcher")
    work = tmp_path_factory.mktemp("front-door")
    launcher = shlex.split(os.environ.get("HOSTILE_LAUNCHER", "")) or None
    cwd = Path(os.environ["HOSTILE_LAUNCHER_CWD"]) if os.environ.get("HOSTILE_LAUNCHER_CWD") else None
    running = full_stack.launch(
        full_stack.shipped_repository(work / "model_repository"),
        work / "launcher.log",
        launcher=launcher,
        cwd=cwd,
        nofile=1024,  # a common container default: without the proxy ~1,100 idle connections suffice
        legacy=LEGACY,
        env={} if LEGACY else {"TRITON_CLIENT_KEYS_FILE": full_stack.write_client_keys(work)},  # keyed rules on
    )
    yield running
    running.stop()


def assert_held(outcome: hostile.Outcome, stack: full_stack.Stack) -> None:
    print(f"\n{outcome.row()}")
    assert outcome.held, f"{outcome.attack}: {outcome.detail}\n{stack.log_tail()}"


def test_admin_apis_logging_and_trace_need_the_key_and_stub_regions_are_never_registered(stack):
    assert_held(hostile.admin_surface(stack), stack)


def test_the_admin_key_is_on_no_command_line_and_the_front_door_files_are_private(stack):
    assert_held(hostile.secrets_exposed(stack), stack)


def test_a_json_shape_larger_than_its_body_is_refused_before_the_server(stack):
    if not stack.proxied and stack.cage is None:
        pytest.skip("without the proxy this body takes the host's memory, and no memory cgroup can hold it here")
    assert_held(hostile.json_shape(stack), stack)


def test_an_idle_connection_flood_from_one_address_leaves_others_served(stack):
    assert_held(hostile.idle_flood(stack, connections=1200, hold_s=4.0), stack)


def test_an_unread_stream_of_tiny_requests_pins_no_memory_and_sheds_no_one(stack):
    assert_held(hostile.unread_stream(stack, seconds=8.0), stack)


def post(port: int, path: str, body: bytes, headers: dict | None = None) -> tuple[int | None, str]:
    return full_stack.request(port, "POST", path, body, {"Content-Type": "application/json", **(headers or {})})


@pytest.mark.parametrize(
    "body, headers, status, message",
    [
        (b'{"inputs":[' * 40 + b"]}" * 40, {}, 400, "nests more than"),
        (
            rb'{"inputs":[{"name":"logits","\u0073hape":[1,1099511627776],"datatype":"FP32","data":[1.0]}]}',
            {},
            400,
            "shape declares",  # the key is decoded, then checked
        ),
        (
            json.dumps(
                {"inputs": [{"name": "logits", "shape": [1, 2**40], "datatype": "FP32", "data": [1.0]}]}
            ).encode(),
            {},
            400,
            "shape declares",
        ),
        (
            json.dumps({"inputs": [{"name": "logits", "shape": [1, 2**40], "datatype": "FP32"}]}).encode(),
            {"Inference-Header-Content-Length": "70"},
            400,
            "not valid JSON",  # a JSON part cut short by its declared length
        ),
        (
            json.dumps({"inputs": [{"name": "logits", "shape": [1, -5], "datatype": "FP32", "data": [1.0]}]}).encode(),
            {},
            400,
            "non-negative integers",
        ),
        (b"{" + b" " * 20000 + b"}", {}, 413, "send tensors as binary data"),
        (b"{}", {"Content-Encoding": "gzip"}, 400, "compressed"),
    ],
    ids=["nested", "escaped-key", "huge-shape", "cut-json", "negative-shape", "json-over-cap", "compressed"],
)
def test_the_proxy_refuses_what_tritonserver_would_choke_on(stack, body, headers, status, message):
    if not stack.proxied:
        pytest.skip("the proxy's own checks")
    answer = post(stack.ports["http"], "/v2/models/sampler/infer", body, headers)
    assert answer[0] == status and message in answer[1], answer
    assert stack.sampler_answers()


def test_chunked_and_oversized_bodies_are_refused_before_they_are_read(stack):
    if not stack.proxied:
        pytest.skip("the proxy's own checks")
    conn = http.client.HTTPConnection("127.0.0.1", stack.ports["http"], timeout=10)
    conn.putrequest("POST", "/v2/models/sampler/infer")
    conn.putheader("Content-Length", str(2**31))  # no body follows: the cap is checked on the header
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and "request body over" in response.read().decode()
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", stack.ports["http"], timeout=10)
    conn.putrequest("POST", "/v2/models/sampler/infer")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    conn.send(b"2\r\n{}\r\n0\r\n\r\n")
    response = conn.getresponse()
    assert response.status == 400 and "chunked" in response.read().decode()
    conn.close()


def test_metrics_and_probe_ports_answer_reads_only(stack):
    if not stack.proxied:
        pytest.skip("the proxy's own routes")
    assert full_stack.request(stack.ports["metrics"], "GET", "/metrics")[0] == 200
    assert full_stack.request(stack.ports["metrics"], "POST", "/metrics", b"x")[0] == 405
    assert full_stack.request(stack.ports["metrics"], "GET", "/elsewhere")[0] == 404
    assert full_stack.request(stack.ports["probe"], "GET", "/ready")[0] == 200
    assert full_stack.request(stack.ports["probe"], "DELETE", "/ready")[0] == 405
    # the front door's own refusals, read from HAProxy's exporter by the supervisor (ops.proxy_metrics)
    status, text = full_stack.request(stack.ports["probe"], "GET", "/metrics")
    assert status == 200 and 'proxy_requests_refused_total{frontend="http",reason="queue_full"}' in text, text


@pytest.mark.parametrize(
    "port_name, path",
    [
        ("http", "/v2/health/ready"),
        ("http", "/v2"),
        ("http", "/v2/models/sampler/config"),
        ("metrics", "/metrics"),
        ("probe", "/ready"),
        ("probe", "/live"),
        ("api", "/health"),
        ("api", "/v1/models"),
    ],
)
def test_a_head_gets_the_head_of_the_get_answer_on_every_port(stack, port_name, path):
    """Uptime monitors and `wget --spider` health checks send HEAD, which RFC 9110 asks of every
    server that answers GET; tritonserver, its metrics and the API answer GET only, and the
    supervisor's probe answered HEAD with a 501 HTML page."""
    if not stack.proxied:
        pytest.skip("the proxy's own routes")
    conn = http.client.HTTPConnection("127.0.0.1", stack.ports[port_name], timeout=30)
    try:
        conn.request("HEAD", path)
        head = conn.getresponse()
        assert head.read() == b""
        # where the connection is kept, a body sent after the HEAD's head would be read as this answer
        conn.request("GET", path)
        get = conn.getresponse()
        body = get.read()
    finally:
        conn.close()
    assert head.status == get.status == 200, (head.status, get.status)
    assert head.getheader("content-type") == get.getheader("content-type")
    if port_name in ("http", "api"):  # the same answer (the probe's report and the metrics move)
        assert int(head.getheader("content-length")) == len(body)


# The front door's frontends docs/metrics.md lists: the only ones its /metrics exports.
DOCUMENTED_FRONTENDS = {"http", "grpc", "api", "metrics", "probe"}
SCRAPES = 5


def test_scraping_the_door_metrics_counts_no_refusal(stack):
    """Each scrape of :probe/metrics reads HAProxy's exporter through a frontend of its own: that
    is no answer of the door's, so no refusal counter moves, whatever the scrape rate."""
    if not stack.proxied:
        pytest.skip("the proxy's own metrics")

    def refused() -> dict[tuple[str, str], float]:
        status, text = full_stack.request(stack.ports["probe"], "GET", "/metrics")
        assert status == 200, text
        families = text_string_to_metric_families(text)
        samples = [sample for family in families for sample in family.samples]
        counters = "proxy_requests_refused_total"
        return {(s.labels["frontend"], s.labels["reason"]): s.value for s in samples if s.name == counters}

    first = refused()
    for _ in range(SCRAPES - 1):
        last = refused()
    assert {frontend for frontend, _ in first} <= DOCUMENTED_FRONTENDS, sorted(first)
    assert {"http", "grpc", "probe"} <= {frontend for frontend, _ in first}
    assert {key: last[key] - first[key] for key in first if last[key] != first[key]} == {}


def listening_addresses(port: int) -> set[str]:
    """The local IPv4 addresses (dotted) that listen on `port`, IPv4-mapped IPv6 ones included."""
    found = set()
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status != psutil.CONN_LISTEN or connection.laddr.port != port:
            continue
        address = connection.laddr.ip.removeprefix("::ffff:")
        found.add(address if "." in address else f"ipv6 {address}")
    return found


def test_tritonserver_listens_on_loopback_only_and_checks_its_own_internal_key(stack):
    if not stack.proxied:
        pytest.skip("behind the proxy only")
    for port in (stack.server_http_port, stack.server_http_port + 1, stack.server_http_port + 2):  # HTTP, gRPC, metrics
        assert listening_addresses(port) == {"127.0.0.1"}, port
    [pid] = full_stack.pids_with_argument(f"--http-port={stack.server_http_port}")
    argv = psutil.Process(pid).cmdline()
    restricted = [arg for arg in argv if arg.startswith("--http-restricted-api=")]
    assert len(restricted) == 1 and "shared-memory,model-repository,logging,trace:" in restricted[0]
    assert full_stack.ADMIN_KEY not in restricted[0]
    # the user's key does not open tritonserver's own port: only the proxy's internal key does
    status, _ = post(stack.server_http_port, "/v2/logging", b"{}", {ADMIN_HEADER: full_stack.ADMIN_KEY})
    assert status == 403


def test_system_shared_memory_works_through_the_proxy_with_the_key(stack):
    logits = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=8, seed=3, return_sampling_mask=True)
    for protocol, url in (("http", stack.http_url), ("grpc", stack.grpc_url)):
        with SamplerClient(url, protocol=protocol) as plain:
            expected = plain.sample(logits, params).output_ids
        with SamplerClient(url, protocol=protocol, admin_key=full_stack.ADMIN_KEY) as keyed:
            np.testing.assert_array_equal(keyed.sample(logits, params, use_shared_memory=True).output_ids, expected)
    # a region of the client's own, registered and unregistered by hand with the key
    name, key = f"front-door-{os.getpid()}", f"/front-door-{os.getpid()}"
    region = shm.create_shared_memory_region(name, key, 64)
    client = httpclient.InferenceServerClient(stack.http_url)
    try:
        client.register_system_shared_memory(name, key, 64, headers={ADMIN_HEADER: full_stack.ADMIN_KEY})
        client.unregister_system_shared_memory(name, headers={ADMIN_HEADER: full_stack.ADMIN_KEY})
        with pytest.raises(InferenceServerException) as refusal:
            client.register_system_shared_memory(name, key, 64)
        assert refusal.value.status() == "403"
    finally:
        client.close()
        shm.destroy_shared_memory_region(region)


def test_grpc_admin_methods_need_the_key(stack):
    client = grpcclient.InferenceServerClient(stack.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as refusal:
            client.get_model_repository_index()
        assert refusal.value.status() in ("StatusCode.PERMISSION_DENIED", "StatusCode.UNAVAILABLE")
        index = client.get_model_repository_index(headers={GRPC_ADMIN_HEADER: full_stack.ADMIN_KEY})
        assert {model.name for model in index.models} == {"sampler", "generate"}
    finally:
        client.close()


def test_grpcs_standard_health_check_is_public(stack):
    """Kubernetes' grpc probes, grpc_health_probe and gRPC load balancers call
    grpc.health.v1.Health/Check, which tritonserver serves; the door asked them for the admin key."""
    channel = grpc.insecure_channel(stack.grpc_url)
    check = channel.unary_unary("/grpc.health.v1.Health/Check", lambda request: request, lambda answer: answer)
    try:
        # HealthCheckRequest{} is no bytes; HealthCheckResponse{status: SERVING} is field 1 = 1
        assert check(b"", timeout=30) == b"\x08\x01"
    finally:
        channel.close()


def proxy_pid(stack: full_stack.Stack) -> int | None:
    """The pid of the stack's HAProxy (the one given this stack's HTTP port)."""
    for pid in full_stack.pids_with_argument("-db"):
        try:
            if psutil.Process(pid).environ().get("TRITON_HTTP_PORT") == str(stack.ports["http"]):
                return pid
        except psutil.Error:
            continue
    return None


def test_a_dead_proxy_is_restarted_by_the_supervisor(stack):
    if not stack.proxied:
        pytest.skip("behind the proxy only")
    pid = proxy_pid(stack)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while not stack.sampler_answers():
        assert time.monotonic() < deadline, stack.log_tail()
        time.sleep(0.2)
    assert proxy_pid(stack) not in (None, pid)
    assert "haproxy died (signal SIGKILL): restart #1" in stack.log_tail(20000)


# ---- one client cannot hold every slot, and no spelling of the key gets past its check ----
# Each attack comes from an address of its own on loopback (127.0.0.x), so that the well-behaved
# client on 127.0.0.1 is another source, as in production; each test checks that client is
# served while the attack goes on.


def skip_unless_proxied(stack) -> None:
    if not stack.proxied:
        pytest.skip("the proxy's own limits")


@pytest.mark.parametrize(
    "attack",
    [
        door_attacks.trickled_bodies,
        door_attacks.route_share,
        door_attacks.header_only_calls,
        door_attacks.header_spellings,
        door_attacks.probe_flood,
        door_attacks.admin_key_guessing,
        door_attacks.abandoned_streams,
    ],
    ids=lambda attack: attack.__name__,
)
def test_the_front_door_holds(stack, attack):
    skip_unless_proxied(stack)
    assert_held(attack(stack), stack)


def test_a_short_admin_key_is_refused_at_start():
    assert door_attacks.short_admin_key(None).held


# ---- the HTTP API through the proxy's API port: what one client can cost it, and who pays ----


@pytest.mark.parametrize(
    "attack",
    [
        api_attacks.prompt_list,
        api_attacks.long_prompt,
        api_attacks.many_messages,
        api_attacks.many_texts,
        api_attacks.request_template,
        api_attacks.big_request,
        api_attacks.abandoned_streams,
        api_attacks.gone_mid_body,
        api_attacks.schema_surface,
        api_attacks.abandoned_requests,
    ],
    ids=lambda attack: attack.__name__,
)
def test_the_api_holds(stack, attack):
    skip_unless_proxied(stack)
    assert_held(attack(stack), stack)
