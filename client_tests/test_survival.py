"""What one request or a load spike could do to `make serve` (issue 15), replayed through the real
server the launcher runs (`python -m triton_sampling_mask.ops.launcher`, supervisor on):

1. a declared shape whose byte size wraps around (4 * (2**62 + 3) = 2**64 + 12 bytes, sent with
   12) kills the model's Python stub, over HTTP binary, gRPC, and a gRPC stream to `generate`;
2. one HTTP JSON body kills tritonserver (arrays nested 60,000 deep; a shape of 2**40);
5. SIGTERM with an idle keep-alive client and a cancelled gRPC stream must end within 10 s, the
   in-flight request answered and no /dev/shm stub region left behind;
6. the shared-memory, model-repository, logging and trace APIs need the admin key; inference does not.

The front door refuses the HTTP bodies of 1 and 2 before they reach tritonserver (the tests check
that); the same bodies sent straight to tritonserver's loopback port still test the recovery.

Each attack must leave the model answering correctly again, and the test prints how long that
took and what failed meanwhile (run with -s to see it). RECOVERY_LIMIT_S only guards against a
server that never comes back: a restart on a busy machine takes as long as its models' loads do.

SURVIVAL_LAUNCHER=/path/to/launcher.py runs the same tests against another launcher script
(started as `python SCRIPT --model-repository DIR`, configured only through the environment),
e.g. the one before issue 15 (`git show HEAD~N:plugin/ops/launcher.py`): every attack test must
then fail.
"""

from __future__ import annotations

import http.client
import json
import mmap
import os
import queue
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from testbed.server import MODEL_REPOSITORY, ExternalTritonServer, TritonServer
from testbed.stack import Stack, launch, pids_with_argument, recover, request, shipped_repository
from triton_sampling_mask.client import SamplerClient, SamplerError
from triton_sampling_mask.client.sampler_client import ADMIN_HEADER as CLIENT_ADMIN_HEADER
from triton_sampling_mask.client.sampling_params import SamplingParams
from triton_sampling_mask.ops import server_process
from triton_sampling_mask.ops.proxy import RESTRICTED
from triton_sampling_mask.ops.shm_cleanup import remove_unused_regions, server_shm_prefix

from .generate_client import generate_inputs

ADMIN_KEY = "survival-test-admin-key-0123456789abcdef"
RECOVERY_LIMIT_S = 180.0
MEMORY_LIMIT_BYTES = 3 * 2**30
SHUTDOWN_LIMIT_S = 10.0
WRAPPED = 2**62 + 3  # FP32: 4 * WRAPPED bytes = 2**64 + 12, i.e. 12 after the wrap
# The proxy's refusals (tritonserver's own say "This API is restricted, expecting header ...").
RESTRICTED_HTTP = f"{RESTRICTED} '{server_process.ADMIN_HEADER}'"
RESTRICTED_GRPC = f"{RESTRICTED} '{server_process.GRPC_ADMIN_HEADER}'"


def assert_recovers(server: Stack, check, attack: str) -> None:
    seconds, failures = recover(check, RECOVERY_LIMIT_S)
    assert seconds is not None, (
        f"{attack}: still failing {RECOVERY_LIMIT_S:g} s later ({dict(failures)})\n{server.log_tail()}"
    )
    print(f"\n{attack}: answered correctly again after {seconds:.1f} s; failed meanwhile: {dict(failures)}")
    # The supervisor counts a restarted server as serving once its watchdog has seen it ready (its
    # /ready; read every 0.2 s): only then is the next attack's kill one of a server that served.
    if not os.environ.get("SURVIVAL_LAUNCHER"):  # an older launcher may have no probe port
        supervised, _ = recover(lambda: (server.ready(), "probe not ready"), RECOVERY_LIMIT_S)
        assert supervised is not None, f"{attack}: the supervisor's /ready never passed\n{server.log_tail()}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`sampler` and `generate` under the launcher, on free ports, with the admin key set."""
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("attacks crash the server and SIGTERM it: they need a local launcher of their own")
    repository = shipped_repository(tmp_path_factory.mktemp("survival") / "model_repository")
    script = os.environ.get("SURVIVAL_LAUNCHER")
    server = launch(
        repository,
        tmp_path_factory.mktemp("survival-logs") / "launcher.log",
        # the JSON shape sent straight to tritonserver grows it until this limit kills it
        env={"TRITON_ADMIN_KEY": ADMIN_KEY, "TRITON_MEMORY_LIMIT_BYTES": MEMORY_LIMIT_BYTES},
        launcher=[sys.executable, script] if script else None,
        legacy=bool(script),
        stack_memory_bytes=None,
        api=False,
        wait_ready=not script,
    )
    try:
        yield server
    finally:
        server.stop()


def test_the_admin_header_is_one_name():
    assert CLIENT_ADMIN_HEADER == server_process.ADMIN_HEADER
    assert server_process.GRPC_ADMIN_HEADER == "triton-grpc-protocol-" + server_process.ADMIN_HEADER
    locked = TritonServer(MODEL_REPOSITORY, admin_key="k3y").command()
    apis = "shared-memory,model-repository,logging,trace"
    assert f"--http-restricted-api={apis}:{server_process.ADMIN_HEADER}=k3y" in locked
    assert f"--grpc-restricted-protocol={apis}:{server_process.ADMIN_HEADER}=k3y" in locked
    assert not any("restricted" in arg for arg in TritonServer(MODEL_REPOSITORY).command())
    with pytest.raises(ValueError):
        server_process.admin_args("a key, with=specials:")


def test_shm_cleanup_removes_only_regions_no_process_uses():
    prefix = f"tsm_cleanup_test_{os.getpid()}_"
    used, unused, other = (
        Path("/dev/shm") / name for name in (prefix + "used", prefix + "unused", f"tsm_other_{os.getpid()}")
    )
    for path in (used, unused, other):
        path.write_bytes(b"\0" * 4096)
    try:
        with open(used, "r+b") as handle, mmap.mmap(handle.fileno(), 4096):
            assert remove_unused_regions(prefix) == [unused.name]
            assert used.exists() and other.exists()
        assert remove_unused_regions(prefix) == [used.name]
        assert other.exists()
        with pytest.raises(ValueError):
            remove_unused_regions("")
    finally:
        for path in (used, unused, other):
            path.unlink(missing_ok=True)


def test_readiness_is_a_real_inference_and_the_probe_command_agrees(served):
    deadline = time.monotonic() + 10  # the watchdog's first round after the models answered
    while (answer := request(served.ports["probe"], "GET", "/ready"))[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    status, text = answer
    assert status == 200, text
    report = json.loads(text)
    assert report["ready"] and {name: (model["ok"], model["kind"]) for name, model in report["models"].items()} == {
        "generate": (True, "generate"),
        "sampler": (True, "sampler"),
    }
    assert request(served.ports["probe"], "GET", "/live")[0] == 200
    probe = [sys.executable, "-m", "triton_sampling_mask.ops.probe", "--url", served.http_url]
    done = subprocess.run(
        [*probe, "--model", "sampler", "--model", "generate"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([*probe, "--model", "no_such_model"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no_such_model: FAILED" in done.stdout, done.stdout + done.stderr


def test_admin_apis_need_the_key_and_inference_does_not(served):
    name, key = f"survival-{os.getpid()}", f"/survival-{os.getpid()}"
    region = shm.create_shared_memory_region(name, key, 64)
    http = httpclient.InferenceServerClient(served.http_url)
    grpc_client = grpcclient.InferenceServerClient(served.grpc_url)
    http_key = {server_process.ADMIN_HEADER: ADMIN_KEY}
    grpc_key = {server_process.GRPC_ADMIN_HEADER: ADMIN_KEY}
    try:
        refused = [
            (lambda: http.register_system_shared_memory(name, key, 64), "403", RESTRICTED_HTTP),
            (lambda: http.load_model("sampler"), "403", RESTRICTED_HTTP),
            (lambda: http.unload_model("sampler"), "403", RESTRICTED_HTTP),
            (
                lambda: http.register_system_shared_memory(
                    name, key, 64, headers={server_process.ADMIN_HEADER: "wrong"}
                ),
                "403",
                RESTRICTED_HTTP,
            ),
            (
                lambda: grpc_client.register_system_shared_memory(name, key, 64),
                "StatusCode.PERMISSION_DENIED",
                RESTRICTED_GRPC,
            ),
            (lambda: grpc_client.load_model("sampler"), "StatusCode.PERMISSION_DENIED", RESTRICTED_GRPC),
            (lambda: grpc_client.unload_model("sampler"), "StatusCode.PERMISSION_DENIED", RESTRICTED_GRPC),
        ]
        for call, status, message in refused:
            with pytest.raises(InferenceServerException) as refusal:
                call()
            assert (refusal.value.status(), refusal.value.message()) == (status, message)
        assert served.sampler_check() == (True, "ok")  # still loaded

        http.register_system_shared_memory(name, key, 64, headers=http_key)
        assert name in json.dumps(http.get_system_shared_memory_status(headers=http_key))
        http.unregister_system_shared_memory(name, headers=http_key)
        grpc_client.register_system_shared_memory(name, key, 64, headers=grpc_key)
        grpc_client.unregister_system_shared_memory(name, headers=grpc_key)
        http.load_model("sampler", headers=http_key)  # already loaded: accepted, nothing changes
        grpc_client.load_model("sampler", headers=grpc_key)

        logits = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
        params = SamplingParams(temperature=0.8, top_k=8, seed=3, return_sampling_mask=True)
        for protocol, url in (("http", served.http_url), ("grpc", served.grpc_url)):
            with SamplerClient(url, protocol=protocol) as plain:  # inference needs no key
                expected = plain.sample(logits, params).output_ids
                with pytest.raises(SamplerError) as refusal:
                    plain.sample(logits, params, use_shared_memory=True)
                assert "restricted" in refusal.value.message
            with SamplerClient(url, protocol=protocol, admin_key=ADMIN_KEY) as keyed:
                np.testing.assert_array_equal(keyed.sample(logits, params, use_shared_memory=True).output_ids, expected)
    finally:
        http.close()  # an idle keep-alive connection would hold the server's shutdown
        grpc_client.close()
        shm.destroy_shared_memory_region(region)


def test_wrapped_shape_over_http_binary_kills_the_stub_and_the_model_comes_back(served):
    header = json.dumps(
        {
            "inputs": [
                {"name": "logits", "shape": [1, WRAPPED], "datatype": "FP32", "parameters": {"binary_data_size": 12}}
            ]
        }
    ).encode()
    body = header + struct.pack("<3f", 1.0, 2.0, 3.0)
    headers = {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}
    status, text = request(served.ports["http"], "POST", "/v2/models/sampler/infer", body, headers)
    if served.server_http_port != served.ports["http"]:  # the proxy refuses a shape larger than the body
        assert status == 400 and "shape declares" in text, (status, text)
        assert served.sampler_check() == (True, "ok")
        status, text = request(served.server_http_port, "POST", "/v2/models/sampler/infer", body, headers)
    # What Triton 2.51 answers the attack itself; anything else means upstream changed: revisit.
    assert status == 500 and "Stub process 'sampler_0_0' is not healthy" in text, (status, text)
    assert_recovers(served, lambda: served.sampler_check(), "wrapped shape, HTTP binary")


def test_wrapped_shape_over_grpc_kills_the_stub_and_the_model_comes_back(served):
    client = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        logits = grpcclient.InferInput("logits", [1, 3], "FP32")
        logits.set_data_from_numpy(np.ones((1, 3), np.float32))
        logits.set_shape([1, WRAPPED])  # declared after the data: tritonclient checks only set_data
        with pytest.raises(InferenceServerException) as answer:
            client.infer("sampler", [logits], client_timeout=30)
        assert "Stub process 'sampler_0_0' is not healthy" in answer.value.message()
    finally:
        client.close()
    assert_recovers(served, lambda: served.sampler_check(), "wrapped shape, gRPC")


def test_wrapped_input_ids_shape_kills_the_generate_stub_and_it_comes_back(served):
    client = grpcclient.InferenceServerClient(served.grpc_url)
    answers: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        inputs = generate_inputs([1, 2, 3], 4)
        inputs[0].set_shape([1, WRAPPED])  # input_ids
        client.async_stream_infer("generate", inputs)
        _, error = answers.get(timeout=30)
        assert error is not None and "Stub process 'generate_0_0' is not healthy" in error.message(), error
        client.stop_stream()
    finally:
        client.close()
    assert_recovers(served, lambda: served.generate_check(), "wrapped input_ids shape, gRPC stream to generate")


def _kill_with_json(served: Stack, body: bytes, attack: str, refusal: tuple[int, str]) -> None:
    headers = {"Content-Type": "application/json"}
    status, text = request(served.ports["http"], "POST", "/v2/models/sampler/infer", body, headers)
    if served.server_http_port != served.ports["http"]:  # the proxy refuses it before tritonserver sees it
        assert status == refusal[0] and refusal[1] in text, (status, text[:200])
        assert served.sampler_check() == (True, "ok")
        status, text = request(served.server_http_port, "POST", "/v2/models/sampler/infer", body, headers)
    # Triton 2.51 dies without answering, and the supervisor restarts it; newer servers refuse the
    # body with a clean 400 (shape checks since 2.68, iterative JSON parsing since 2.69) and keep
    # running. Any other answer means upstream changed: revisit the test.
    assert status is None or (status == 400 and '"error"' in text), (status, text[:200])
    assert_recovers(served, lambda: served.sampler_check(), attack)
    assert served.process.poll() is None, "the launcher itself died"
    assert served.generate_check()[0], "generate did not come back with the restarted server"
    if served.server_http_port != served.ports["http"]:
        # a server that had served was killed by a request: restarted at once, the backoff not escalated
        deaths = [line for line in served.log_tail(200_000).splitlines() if "tritonserver died" in line]
        assert deaths and "of serving; restart" in deaths[-1] and deaths[-1].endswith("in 0.5 s"), deaths


def test_deeply_nested_json_kills_tritonserver_and_it_comes_back(served):
    depth = 60_000
    body = '{"inputs":[{"name":"logits","shape":[1,8],"datatype":"FP32","data":' + "[" * depth + "]" * depth + "}]}"
    _kill_with_json(
        served,
        body.encode(),
        "JSON nested 60,000 deep (tritonserver SIGSEGV)",
        (413, "send tensors as binary data"),  # 120 KB of JSON: over the proxy's JSON cap already
    )


def test_huge_json_shape_kills_tritonserver_and_it_comes_back(served):
    if "[supervisor] memory limit" not in served.log_tail(200_000):
        pytest.skip("tritonserver runs without a memory limit here: this body would take the host's memory")
    body = json.dumps({"inputs": [{"name": "logits", "shape": [1, 2**40], "datatype": "FP32", "data": [1.0, 2.0]}]})
    _kill_with_json(
        served,
        body.encode(),
        "JSON shape [1, 2**40] (tritonserver std::bad_alloc)",
        (400, "shape declares"),
    )


def test_sigterm_with_idle_clients_and_a_cancelled_stream_stops_in_10s_leaving_nothing(served):
    """Runs last: it stops the module's server."""
    idle = http.client.HTTPConnection("127.0.0.1", served.ports["http"], timeout=30)
    idle.request("GET", "/v2/health/ready")
    idle.getresponse().read()  # answered; the connection stays open, idle
    channel = grpc.insecure_channel(served.grpc_url)
    hold = threading.Event()
    stream_request = service_pb2.ModelInferRequest(model_name="generate", id="cancelled")
    for tensor in generate_inputs([5, 6, 7], 3, stream=True, ignore_eos=True):
        stream_request.inputs.append(tensor._get_tensor())
        stream_request.raw_input_contents.append(tensor._get_content())

    def requests():
        yield stream_request
        hold.wait()  # the client never half-closes the stream

    call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())
    for response in call:
        final = response.infer_response.parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            break
    call.cancel()  # after its final response; the channel stays open

    in_flight: dict = {}

    def generate_100_tokens() -> None:
        body = json.dumps({"input_ids": [5, 6, 7], "max_new_tokens": 100, "ignore_eos": True}).encode()
        status, text = request(served.ports["http"], "POST", "/v2/models/generate/generate", body, timeout_s=30)
        in_flight.update(status=status, tokens=len(json.loads(text)["output_ids"]) if status == 200 else text)

    worker = threading.Thread(target=generate_100_tokens)
    worker.start()
    time.sleep(0.2)
    try:
        seconds = served.stop()
    finally:
        worker.join(30)
        hold.set()
        idle.close()
        channel.close()
    print(f"\nSIGTERM with an idle keep-alive client and a cancelled stream: launcher exited after {seconds:.1f} s")
    assert served.process.returncode == 0, served.log_tail()
    assert seconds <= SHUTDOWN_LIMIT_S, served.log_tail()
    assert in_flight == {"status": 200, "tokens": 100}, in_flight
    prefix = server_shm_prefix(served.ports["http"])
    assert sorted(p.name for p in Path("/dev/shm").glob(prefix + "*")) == [], served.log_tail()
    assert not pids_with_argument(f"--http-port={served.server_http_port}"), "tritonserver outlived the launcher"
