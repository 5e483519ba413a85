"""A real tritonserver on free ports for the whole session, with HTTP and gRPC clients.

The session's server is what `make serve` runs: tritonserver on loopback behind its front door
(HAProxy and the gRPC stream gate, `testbed.fronted.FrontedTritonServer`), its admin APIs open as with
`--open-admin-apis`; the tests reach it only through the proxy's ports, as users do. A test of
tritonserver's own answers starts a server of its own and says why. Without HAProxy (a host where
`make setup` could not install it) the session falls back to the bare server, with a warning.

With TRITON_EXTERNAL_HTTP_URL set (docker/run-gpu-tests.sh) every test runs against that server
instead, and the tests that need a local server of their own are skipped, each for a stated
reason. The run ends with a summary of what ran where.
"""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from testbed.api_server import ApiProcess
from testbed.fronted import FrontedTritonServer
from testbed.server import ExternalTritonServer, TritonServer, build_test_repository
from triton_sampling_mask.ops.proxy import find_haproxy

# Tests that start a tritonserver of their own on this host (nodeid -> why that cannot be the
# external server). Against an external server they are skipped with that reason.
OWN_SERVER_TESTS = {
    "client_tests/test_make_serve.py::test_make_serve_honours_the_environment_and_stops_on_sigterm": (
        "tests `make serve`, the local launcher on this host; the container runs docker/serve.sh instead"
    ),
    "client_tests/test_sampler_checks.py::test_unknown_backend_fails_model_load_listing_the_choices": (
        "needs a repository with a broken model of its own; a failed model load happens before any device is used"
    ),
}
OWN_SERVER_REASON = "starts a local CPU tritonserver of its own; with an external server only that server is tested"
SERVER_FIXTURES = ("triton_server", "explicit_server")
_where: dict[str, str] = {}  # nodeid -> where the test ran
_outcomes: dict[str, tuple[str, str]] = {}  # nodeid -> (outcome, skip reason)


def _place(item, external: ExternalTritonServer | None) -> str:
    if "served" in item.fixturenames:  # test_survival: a launcher of its own, crashed and SIGTERMed
        return "nowhere (needs a local launcher of its own)" if external else "a local supervised launcher of its own"
    if "stack" in item.fixturenames:  # test_front_door: the launcher's front door, attacked
        return "nowhere (needs a local launcher of its own)" if external else "a local launcher behind its front door"
    if external is not None and item.nodeid.split("[")[0] in OWN_SERVER_TESTS:
        return "nowhere (needs a local server of its own)"
    if external is not None and any(name in item.fixturenames for name in SERVER_FIXTURES):
        return f"the external server {external.http_url}"
    if "api_server" in item.fixturenames:
        return "the session's local CPU server, through the HTTP API process"
    if "triton_server" in item.fixturenames:
        return "the session's local CPU server, behind its front door"
    if item.nodeid.startswith("client_tests/test_scale_out.py"):
        return "three local CPU servers of its own"
    if item.nodeid.startswith(
        (
            "client_tests/test_generate_engine.py",
            "client_tests/test_speculative.py",
            "client_tests/test_checkpoints.py",
            "client_tests/test_weight_updates.py",
            "client_tests/test_api_weights.py",
            "client_tests/test_tracing.py",
        )
    ):
        return "a local CPU server of its own"
    if "slow_server" in item.fixturenames:  # test_load_shedding
        return (
            "nowhere (needs a local server of its own)" if external else "a local CPU server behind a proxy of its own"
        )
    if "explicit_server" in item.fixturenames or item.nodeid.split("[")[0] in OWN_SERVER_TESTS:
        return "a local CPU server of its own"
    return "no server (client side only)"


def pytest_collection_modifyitems(config, items):
    external = ExternalTritonServer.from_environment()
    for item in items:
        if not item.nodeid.startswith("client_tests/"):
            continue
        _where[item.nodeid] = _place(item, external)
        reason = OWN_SERVER_TESTS.get(item.nodeid.split("[")[0])
        if external is not None and reason:
            item.add_marker(pytest.mark.skip(reason=reason))
        elif external is not None and "served" in item.fixturenames:
            item.add_marker(
                pytest.mark.skip(reason="crashes and SIGTERMs the server it tests: needs a local launcher of its own")
            )
        elif external is not None and "stack" in item.fixturenames:
            item.add_marker(pytest.mark.skip(reason="attacks the launcher's own front door: needs a local launcher"))


def pytest_runtest_logreport(report):
    if report.nodeid not in _where:
        return
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _outcomes[report.nodeid] = ("skipped", reason.removeprefix("Skipped: "))
        if reason.endswith(OWN_SERVER_REASON):  # caught starting a local server beside the external one
            _where[report.nodeid] = "nowhere (needs a local server of its own)"
    elif report.failed:
        _outcomes[report.nodeid] = ("failed", "")
    elif report.when == "call":
        _outcomes.setdefault(report.nodeid, ("passed", ""))


def pytest_terminal_summary(terminalreporter):
    if not _outcomes:
        return
    counts: dict[str, Counter] = defaultdict(Counter)
    skips: Counter = Counter()
    for nodeid, (outcome, reason) in _outcomes.items():
        counts[_where[nodeid]][outcome] += 1
        if outcome == "skipped":
            skips[reason] += 1
    terminalreporter.write_sep("-", "client tests: where they ran")
    for place, outcome_counts in sorted(counts.items()):
        terminalreporter.write_line(f"{place}: " + ", ".join(f"{n} {o}" for o, n in sorted(outcome_counts.items())))
    for reason, count in skips.most_common():
        terminalreporter.write_line(f"skipped ({count}): {reason}")


@pytest.fixture(scope="session", autouse=True)
def no_local_server_beside_an_external_one():
    """Against an external server, a test that would start a local one is skipped, not run on CPU."""
    if ExternalTritonServer.from_environment() is None:
        yield
        return

    def refuse(self, *args, **kwargs):
        pytest.skip(OWN_SERVER_REASON)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TritonServer, "start", refuse)
        yield


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    external = ExternalTritonServer.from_environment()
    if external is not None:  # docker/run-gpu-tests.sh serves the same repository in a container
        yield external
        return
    repository = build_test_repository(tmp_path_factory.mktemp("models") / "model_repository")
    log_path = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    if find_haproxy() is None:
        warnings.warn("haproxy is not installed: the client tests run against the bare tritonserver", stacklevel=1)
        server = TritonServer(repository, log_path=log_path)
    else:
        server = FrontedTritonServer(repository, log_path=log_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def api_server(triton_server):
    """The HTTP API process (`python -m triton_sampling_mask.api`) in front of the session's server;
    it must leave with exit code 0 on SIGTERM, as a supervisor expects."""
    api = ApiProcess(triton_server.grpc_url).start()
    yield api
    code = api.stop()
    assert code == 0, f"the API exited with {code} on SIGTERM:\n{api.log_tail()}"


@pytest.fixture(scope="session")
def http_client(triton_server):
    client = httpclient.InferenceServerClient(triton_server.http_url, concurrency=16)
    yield client
    client.close()


@pytest.fixture(scope="session")
def grpc_client(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    yield client
    client.close()


@pytest.fixture(params=["http", "grpc"])
def protocol(request, http_client, grpc_client):
    """(client, tritonclient module) for each protocol in turn."""
    if request.param == "http":
        return http_client, httpclient
    return grpc_client, grpcclient
