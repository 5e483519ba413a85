"""Load shedding at the front door: the proxy lets a model route hold a bounded number of requests
in tritonserver and queues the next ones itself; beyond its queue a request is refused at once,
and one that waited out the queue timeout is refused too, with 503 / UNAVAILABLE, before its body
ever reaches the server. Checked through the real proxy in front of a real server whose sampler
is slowed to 0.5 s an execute, over HTTP and gRPC, unary calls and ModelStreamInfer streams (whose
queue the stream gate keeps)."""

from __future__ import annotations

import json
import queue
import shutil
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from testbed.fronted import FrontedTritonServer
from testbed.server import MODEL_REPOSITORY, copy_model, set_parameter
from triton_sampling_mask.client import GenerateClient, SamplerClient
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.client.wire import sampler_inputs
from triton_sampling_mask.ops import proxy_metrics, settings
from triton_sampling_mask.ops.proxy import QUEUE_FULL, QUEUE_TIMEOUT, ProxyLimits, find_haproxy

MODEL = "sampler_slow"
# Small numbers, so a burst of a few dozen requests covers every case: two requests at the server
# (one batch of 0.5 s), six waiting in the proxy, the rest refused at once; of the queued ones,
# those that get no slot within 0.6 s (all but the first pair) are refused then.
LIMITS = ProxyLimits(max_in_flight=2, max_queue=6, queue_timeout_s=0.6)
BURST = 24


def test_the_shipped_settings_shed_as_the_docs_say():
    """Beyond 32 waiting a request is refused at once, after 2 s queued too."""
    assert settings.PROXY_MAX_QUEUE.default == 32 and settings.PROXY_QUEUE_TIMEOUT_S.default == 2.0
    assert ProxyLimits().max_queue == 32 and ProxyLimits().queue_timeout_s == 2.0


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    """The shipped sampler over a backend 0.5 s slower per execute, behind a front door of its own."""
    if find_haproxy() is None:
        pytest.skip("haproxy is not installed (make setup installs it where it can)")
    repository = tmp_path_factory.mktemp("shedding")
    copy_model(repository, "sampler", MODEL, backend="slow_backend:SlowBackend")
    with FrontedTritonServer(repository, limits=LIMITS) as server:
        yield server


def burst(server, protocol: str, requests: int) -> list[str]:
    """`requests` concurrent one-row requests: "ok", or why each was refused (QUEUE_FULL,
    QUEUE_TIMEOUT, or the status and message of anything else)."""
    module = httpclient if protocol == "http" else grpcclient
    shed_status = "503" if protocol == "http" else "StatusCode.UNAVAILABLE"
    logits = np.random.default_rng(0).standard_normal((1, 2000)).astype(np.float32)

    def one(_):
        client = (
            httpclient.InferenceServerClient(server.http_url)
            if protocol == "http"
            else grpcclient.InferenceServerClient(server.grpc_url)
        )
        try:
            client.infer(MODEL, sampler_inputs(module, logits, top_k=5, return_sampling_mask=True))
            return "ok"
        except InferenceServerException as error:
            for reason in (QUEUE_FULL, QUEUE_TIMEOUT):
                if str(error.status()) == shed_status and reason in error.message():
                    return reason
            return f"{error.status()} {error.message()}"
        finally:
            client.close()

    with ThreadPoolExecutor(requests) as pool:
        return list(pool.map(one, range(requests)))


def refusal_counts(server, protocol: str) -> dict:
    """The front door's refusal counters for the protocol's frontend, as its /metrics exports them."""
    return proxy_metrics.refusals(proxy_metrics.scrape(server.front_door.stats_socket))[protocol]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_burst_is_refused_at_once_beyond_the_queue_and_after_the_queue_timeout(slow_server, protocol):
    counted = slow_server.front_door.stats_socket is not None  # haproxy has its exporter built in
    before = refusal_counts(slow_server, protocol) if counted else {}
    outcomes = burst(slow_server, protocol, BURST)
    assert set(outcomes) <= {"ok", QUEUE_FULL, QUEUE_TIMEOUT}, outcomes
    admitted = outcomes.count("ok")
    # at least the first batch; at most what the server holds plus the whole queue
    assert LIMITS.max_in_flight <= admitted <= LIMITS.max_in_flight + LIMITS.max_queue, outcomes
    assert outcomes.count(QUEUE_FULL) >= 1 and outcomes.count(QUEUE_TIMEOUT) >= 1, outcomes
    assert slow_server.process.poll() is None
    if counted:  # each refusal is counted under its own reason, and nothing else is
        after = refusal_counts(slow_server, protocol)
        moved = {reason: after[reason] - before[reason] for reason in proxy_metrics.REASONS + ("received",)}
        assert moved == {
            "queue_full": outcomes.count(QUEUE_FULL),
            "queue_timeout": outcomes.count(QUEUE_TIMEOUT),
            "refused": 0,
            "connection_cap": 0,
            "bad_request": 0,
            "received": BURST,
        }, (moved, outcomes)


def received(server) -> int:
    """The requests tritonserver has received for MODEL (it counts every one), asked directly."""
    url = f"http://{server.server.http_url}/v2/models/{MODEL}/stats"
    with urllib.request.urlopen(url) as response:
        stats = json.loads(response.read())["model_stats"][0]["inference_stats"]
    return int(stats["success"]["count"]) + int(stats["fail"]["count"])


def test_refused_requests_never_reach_the_server(slow_server):
    """Triton counts every request it receives: the refused ones must not be among them."""
    before = received(slow_server)
    outcomes = burst(slow_server, "http", BURST)
    assert received(slow_server) - before == outcomes.count("ok"), outcomes


def open_stream(server) -> tuple[grpcclient.InferenceServerClient, queue.Queue]:
    """A tritonclient ModelStreamInfer stream with one request sent, left open: the client, and
    where its outcome arrives ("ok", or (status, message))."""
    outcomes: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(
        callback=lambda result, error: outcomes.put("ok" if error is None else (str(error.status()), error.message()))
    )
    logits = np.random.default_rng(2).standard_normal((1, 2000)).astype(np.float32)
    client.async_stream_infer(MODEL, sampler_inputs(grpcclient, logits, top_k=5))
    return client, outcomes


def test_streams_are_refused_unavailable_with_the_proxys_message_beyond_the_queue_and_after_its_timeout(slow_server):
    """Streams that keep the route's slots (open after their answer, as a trainer's stream is), then
    one stream more than the queue holds: one is refused at once, the queued ones after the queue
    timeout, each with UNAVAILABLE and the message a unary call or HTTP gets (HAProxy 2.4 and 2.6
    would reset a stream they answer themselves: CANCELLED). None of their requests reaches the
    server, and the front door's metrics count each refusal under its reason."""
    stats, gate = slow_server.front_door.stats_socket, slow_server.front_door.gate_socket
    before = proxy_metrics.counts(stats, gate)["grpc"] if stats else {}
    streams = []
    try:
        streams += [open_stream(slow_server) for _ in range(LIMITS.max_in_flight)]
        assert [outcomes.get(timeout=60) for _, outcomes in streams] == ["ok"] * LIMITS.max_in_flight
        reached = received(slow_server)
        streams += [open_stream(slow_server) for _ in range(LIMITS.max_queue + 1)]
        refusals = sorted(outcomes.get(timeout=60) for _, outcomes in streams[LIMITS.max_in_flight :])
        unavailable = "StatusCode.UNAVAILABLE"
        assert refusals == sorted([(unavailable, QUEUE_FULL)] + [(unavailable, QUEUE_TIMEOUT)] * LIMITS.max_queue)
        assert received(slow_server) == reached
        if stats:
            after = proxy_metrics.counts(stats, gate)["grpc"]
            moved = {reason: after[reason] - before[reason] for reason in proxy_metrics.REASONS + ("received",)}
            assert moved == {
                "queue_full": 1,
                "queue_timeout": LIMITS.max_queue,
                "refused": 0,
                "connection_cap": 0,
                "bad_request": 0,
                "received": len(streams),
            }, moved
    finally:
        for client, _ in streams:
            client.stop_stream(cancel_requests=True)
            client.close()


# The busy contract end to end: a generate deployment whose engine takes few waiting requests,
# behind a front door that lets few into tritonserver and queues fewer, so that a big submission
# is refused as busy both at the proxy (HTTP) and by the engine (both protocols).
BUSY_LIMITS = ProxyLimits(max_in_flight=8, max_queue=4, queue_timeout_s=0.5)
SUBMISSION = 2000


@pytest.fixture(scope="module")
def busy_generate_server(tmp_path_factory):
    """The shipped generate model, its engine's waiting list cut to 16, behind a tight front door."""
    if find_haproxy() is None:
        pytest.skip("haproxy is not installed (make setup installs it where it can)")
    repository = tmp_path_factory.mktemp("busy")
    shutil.copytree(
        MODEL_REPOSITORY / "generate", repository / "generate", ignore=shutil.ignore_patterns("__pycache__")
    )
    config = repository / "generate" / "config.pbtxt"
    config.write_text(set_parameter(config.read_text(), "max_waiting", "16"))
    with FrontedTritonServer(repository, limits=BUSY_LIMITS) as server:
        yield server


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_big_submission_completes_through_busy_refusals(busy_generate_server, protocol):
    """2,000 prompts in one call with the clients' defaults: every one completes, each refusal
    retried after a backoff (one marker shared by the proxy, the engine and the client)."""
    url = busy_generate_server.http_url if protocol == "http" else busy_generate_server.grpc_url
    prompts = [[1 + i % 50, 2 + i % 7] for i in range(SUBMISSION)]
    with GenerateClient(url, protocol=protocol) as client:
        results = client.generate(prompts, SamplingParams(seed=7), max_new_tokens=1, outputs=["output_ids"])
        refusals = client.busy_refusals
    assert len(results) == SUBMISSION and all(len(result.output_ids) == 1 for result in results)
    assert refusals > 0, "nothing was refused as busy: the test did not force shedding"
    assert busy_generate_server.process.poll() is None


def test_the_sampler_client_retries_a_shed_request(slow_server):
    """The sampler client reads the proxy's shedding as busy: retried after a backoff, not raised,
    and the replica is not ejected for it."""
    logits = np.random.default_rng(1).standard_normal((1, 2000)).astype(np.float32)
    with ThreadPoolExecutor(BURST) as pool, SamplerClient(slow_server.http_url, model_name=MODEL) as client:
        results = list(pool.map(lambda _: client.sample(logits, SamplingParams(top_k=5)), range(BURST)))
        assert client.busy_refusals > 0 and client.healthy_replicas() == [slow_server.http_url]
    assert all(result.output_ids.shape == (1,) for result in results)
