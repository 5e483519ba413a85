"""Load shedding through the real server: beyond the shipped queue policy, requests are refused at
once with 503 / UNAVAILABLE (never queued without bound), and admitted ones are answered."""

from __future__ import annotations

import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from triton_sampling_mask.client.wire import sampler_inputs
from triton_sampling_mask.ops.server_process import TritonServer

from .server import MODEL_REPOSITORY, set_parameter
from .slow_backend import EXECUTE_SECONDS

MODEL = "sampler_slow"


def queue_policy(config_text: str) -> dict[str, int]:
    """The numbers of the default_queue_policy block of a config.pbtxt."""
    block = re.search(r"default_queue_policy\s*\{([^}]*)\}", config_text)
    assert block, "no default_queue_policy: the sampler would queue without bound"
    return {
        key: int(value) if value.isdigit() else value for key, value in re.findall(r"(\w+)\s*:\s*(\w+)", block.group(1))
    }


def test_shipped_models_shed_load_with_bounded_queues():
    for model in ("sampler", "generate"):
        policy = queue_policy((MODEL_REPOSITORY / model / "config.pbtxt").read_text())
        assert 0 < policy["max_queue_size"] <= 64 and policy["timeout_action"] == "REJECT", (model, policy)
    assert (
        0
        < queue_policy((MODEL_REPOSITORY / "sampler" / "config.pbtxt").read_text())["default_timeout_microseconds"]
        <= 2_000_000
    )


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    """The shipped sampler (its queue policy included) over a backend 0.5 s slower per execute."""
    repository = tmp_path_factory.mktemp("shedding")
    model_dir = repository / MODEL
    shutil.copytree(MODEL_REPOSITORY / "sampler", model_dir, ignore=shutil.ignore_patterns("__pycache__"))
    text = (model_dir / "config.pbtxt").read_text().replace('name: "sampler"', f'name: "{MODEL}"')
    (model_dir / "config.pbtxt").write_text(set_parameter(text, "sampling_backend", "slow_backend:SlowBackend"))
    shutil.copy(Path(__file__).parent / "slow_backend.py", model_dir / "1")
    with TritonServer(repository) as server:
        yield server


def burst(server, protocol: str, requests: int) -> list[tuple[str, float]]:
    """`requests` concurrent one-row requests; (outcome, seconds) each."""
    module = httpclient if protocol == "http" else grpcclient
    logits = np.random.default_rng(0).standard_normal((1, 2000)).astype(np.float32)

    def one(_):
        client = (
            httpclient.InferenceServerClient(server.http_url)
            if protocol == "http"
            else grpcclient.InferenceServerClient(server.grpc_url)
        )
        started = time.perf_counter()
        try:
            client.infer(MODEL, sampler_inputs(module, logits, top_k=5, return_sampling_mask=True))
            return "ok", time.perf_counter() - started
        except InferenceServerException as error:
            return str(error.status()), time.perf_counter() - started
        finally:
            client.close()

    with ThreadPoolExecutor(requests) as pool:
        return list(pool.map(one, range(requests)))


@pytest.mark.parametrize("protocol, shed_status", [("http", "503"), ("grpc", "StatusCode.UNAVAILABLE")])
def test_a_burst_beyond_the_queue_is_refused_quickly(slow_server, protocol, shed_status):
    max_queue = queue_policy((MODEL_REPOSITORY / "sampler" / "config.pbtxt").read_text())["max_queue_size"]
    outcomes = burst(slow_server, protocol, 2 * max_queue + 16)
    statuses = [status for status, _ in outcomes]
    assert set(statuses) <= {"ok", shed_status}, statuses
    assert statuses.count("ok") >= 1 and statuses.count(shed_status) >= 1, statuses
    shed_seconds = [seconds for status, seconds in outcomes if status == shed_status]
    # Beyond the queue a request is refused at once: faster than a single execute of the slowed
    # sampler, let alone the whole burst (the others are refused at the queue timeout).
    assert min(shed_seconds) < EXECUTE_SECONDS, shed_seconds
