"""Model lifecycle under load, on a server in explicit model-control mode (a local one of its own,
or the container of docker/run-gpu-tests.sh, started so): unloading and loading the sampler while
clients send never crashes the server or loses a request, and traffic recovers; an internal fault
inside execute is a per-request INTERNAL, not a dead stub."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from testbed.server import (
    FAULTY_SAMPLER,
    ExternalTritonServer,
    TritonServer,
    add_faulty_sampler,
    build_test_repository,
    infer,
)
from triton_sampling_mask.client.sampler_client import admin_headers

from .reliability import INTERNAL, INVALID_ARGUMENT, check_against_reference, expect_error, scrape


def keyed(server) -> dict | None:
    """The admin-key header model control needs where the server locks it (the container does)."""
    return admin_headers("http", getattr(server, "admin_key", None))


FAULTY = FAULTY_SAMPLER
FAULT_LOG = "sampler internal error: RuntimeError: injected sampler fault"  # faulty_backend.py's error, as logged
TEMPERATURE, TOP_K, VOCAB = 0.9, 16, 256
MASK_PARAMS = dict(temperature=TEMPERATURE, top_k=TOP_K, return_sampling_mask=True)
RELOAD_CYCLES = 2
WAIT_STEPS = 1200  # bounded waits (at most 60 s); each ends as soon as its condition holds


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory):
    """A server that loads models on request, with `sampler` loaded and FAULTY not: the external
    server when there is one (it must run in explicit mode), else a local one of its own."""
    external = ExternalTritonServer.from_environment()
    if external is not None:
        if external.model_control != "explicit":
            pytest.skip(
                "the external server does not run in explicit model-control mode "
                "(TRITON_EXTERNAL_MODEL_CONTROL); docker/run-gpu-tests.sh starts the container so"
            )
        yield external
        return
    repository = add_faulty_sampler(build_test_repository(tmp_path_factory.mktemp("reload") / "model_repository"))
    server = TritonServer(
        repository,
        extra_args=["--model-control-mode=explicit", "--load-model=sampler"],
        log_path=tmp_path_factory.mktemp("reload-logs") / "tritonserver.log",
    )
    server.start()
    yield server
    server.stop()


def wait_until(condition) -> bool:
    for _ in range(WAIT_STEPS):
        if condition():
            return True
        time.sleep(0.05)
    return False


def log_count(server, text: str) -> int:
    return server.log_tail(10**8).count(text)


def counter_value(samples: dict, name: str, labels: set) -> float:
    return samples.get((name, frozenset(labels)), 0.0)


class Traffic(threading.Thread):
    """A closed-loop client sending valid mask requests; tallies answers and error responses."""

    def __init__(self, module, url: str, seed: int):
        super().__init__(daemon=True)
        self.module, self.url = module, url
        self.rng = np.random.default_rng(seed)
        self.stop = threading.Event()
        self.ok = 0
        self.errors: Counter = Counter()  # (status, message head) of error responses
        self.lost: list[str] = []  # failures with no response from the server
        self.wrong: list[str] = []

    def run(self) -> None:
        client = self.module.InferenceServerClient(self.url)
        try:
            while not self.stop.is_set():
                logits = self.rng.standard_normal((2, VOCAB)).astype(np.float32)
                try:
                    outputs = infer(client, self.module, "sampler", logits, **MASK_PARAMS)
                except InferenceServerException as exc:
                    self.errors[(exc.status(), exc.message()[:60])] += 1
                    time.sleep(0.01)
                    continue
                except Exception as exc:  # the transport failed: the server did not answer
                    self.lost.append(f"{type(exc).__name__}: {exc}")
                    continue
                try:
                    check_against_reference(outputs, logits, TEMPERATURE, TOP_K, want_mask=True)
                    self.ok += 1
                except AssertionError as exc:
                    self.wrong.append(str(exc)[:200])
        finally:
            client.close()


def test_unload_and_load_under_load(explicit_server):
    control = httpclient.InferenceServerClient(explicit_server.http_url)
    clients = [
        Traffic(httpclient, explicit_server.http_url, seed=1),
        Traffic(httpclient, explicit_server.http_url, seed=2),
        Traffic(grpcclient, explicit_server.grpc_url, seed=3),
        Traffic(grpcclient, explicit_server.grpc_url, seed=4),
    ]
    answered = lambda: sum(c.ok for c in clients)  # noqa: E731
    finalized_before = log_count(
        explicit_server, "sampler finalized"
    )  # an external server's log holds the whole session
    for client in clients:
        client.start()
    try:
        for _ in range(RELOAD_CYCLES):
            before = answered()
            assert wait_until(lambda: answered() >= before + 20), "traffic is not being answered"
            control.unload_model("sampler", headers=keyed(explicit_server))
            assert wait_until(lambda: not control.is_model_ready("sampler"))
            refused = sum(sum(c.errors.values()) for c in clients)
            assert wait_until(lambda: sum(sum(c.errors.values()) for c in clients) >= refused + 4)
            control.load_model("sampler", headers=keyed(explicit_server))
            assert control.is_model_ready("sampler")
            after_load = answered()
            assert wait_until(lambda: answered() >= after_load + 20), "traffic did not recover after load"
    finally:
        for client in clients:
            client.stop.set()
        for client in clients:
            client.join(60)
        control.close()

    assert explicit_server.process.poll() is None, "tritonserver died"
    assert [c.lost for c in clients] == [[]] * len(clients)
    assert [c.wrong for c in clients] == [[]] * len(clients)
    errors = sum((c.errors for c in clients), Counter())
    print(f"answered {answered()}, error responses while unloaded: {dict(errors)}")
    # While unloaded, the server itself answers: 'unknown model' / 'unavailable', never a 5xx fault.
    for (status, message), count in errors.items():
        assert status not in INTERNAL, (status, message, count)
        assert "sampler" in message, (status, message, count)
    # finalize ran at every unload (an external server's log may trail by a moment)
    assert wait_until(lambda: log_count(explicit_server, "sampler finalized") >= finalized_before + RELOAD_CYCLES)


def test_internal_fault_is_a_per_request_500_and_the_stub_survives(explicit_server):
    client = httpclient.InferenceServerClient(explicit_server.http_url)
    gclient = grpcclient.InferenceServerClient(explicit_server.grpc_url)
    internal = {("model", FAULTY), ("version", "1"), ("outcome", "internal"), ("reason", "internal")}
    internal_before = counter_value(scrape(explicit_server.metrics_url), "sampler_requests_total", internal)
    faults_before = log_count(explicit_server, FAULT_LOG)
    try:
        client.load_model(FAULTY, headers=keyed(explicit_server))
        logits = np.random.default_rng(0).standard_normal((1, VOCAB)).astype(np.float32)
        for c, module in ((client, httpclient), (gclient, grpcclient), (client, httpclient)):
            message = expect_error(lambda: infer(c, module, FAULTY, logits, top_k=4), INTERNAL)
            assert message == "internal sampler error (RuntimeError); see the server log"
            # User errors are still 400s: they are answered before the sampler runs.
            message = expect_error(lambda: infer(c, module, FAULTY, logits, top_p=0.0), INVALID_ARGUMENT)
            assert "top_p" in message
        assert client.is_model_ready(FAULTY)
        samples = scrape(explicit_server.metrics_url)
        assert counter_value(samples, "sampler_requests_total", internal) == internal_before + 3
        assert wait_until(lambda: log_count(explicit_server, FAULT_LOG) > faults_before)
        assert "Traceback" in explicit_server.log_tail(10**7)
        # The sampler beside it never noticed.
        outputs = infer(client, httpclient, "sampler", logits, **MASK_PARAMS)
        check_against_reference(outputs, logits, TEMPERATURE, TOP_K, want_mask=True)
    finally:
        try:
            client.unload_model(FAULTY, headers=keyed(explicit_server))
        finally:
            client.close()  # an open connection would hold the server's shutdown for 30 s
            gclient.close()
