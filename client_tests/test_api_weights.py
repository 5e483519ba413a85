"""The weight routes of the HTTP API against a real tritonserver of its own (float64 LM, an admin
key, a weights root), driven with the bodies AReaL 1.0.4 and skyrl-train 0.3.1 send
(tests/test_api_weight_routes.py cites them): weight sync over a gloo group whose trainer side is
opened as those frameworks open it (SGLang's init_custom_process_group, in a process of its own),
disk updates, the memory routes; a refused abort-mode update that leaves the requests in flight
running; and the 10-wrong-keys-a-minute limit per client address, across the API and the control
input."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from testbed.api_server import ApiProcess
from testbed.server import ExternalTritonServer, TritonServer
from tests.weights_fixtures import moved_model
from triton_sampling_mask.client import GenerateClient, GenerateError
from triton_sampling_mask.client.generate_transport import GrpcConnection
from triton_sampling_mask.client.weight_updates import control_request
from triton_sampling_mask.sampling.admin import CLIENT_ADDRESS_PARAMETER, WRONG_KEYS_PER_MINUTE

from .test_generate_engine import build_engine_repository
from .test_weight_updates import ADMIN_KEY, MODEL, PARAMS, PROMPTS, SEEDS, assert_replayed, generate

GROUP_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("api_weights_root")
    for version, seed in SEEDS.items():
        if seed is not None:
            moved_model(seed).save_pretrained(root / version)
    from safetensors.torch import load_file, save_file

    moved_model(23).save_pretrained(root / "nan")
    tensors = load_file(root / "nan" / "model.safetensors")
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, root / "nan" / "model.safetensors")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, weights_root):
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("starts a local CPU tritonserver with a weights root and an admin key of its own")
    variant = {MODEL: {"lm_dtype": "float64", "weights_root": str(weights_root)}}
    repository = build_engine_repository(tmp_path_factory.mktemp("api_weights_models"), variant)
    log = tmp_path_factory.mktemp("api_weights_logs") / "tritonserver.log"
    # the front door's client-address header forwarded to the model, as loopback_args() does
    forward = [f"--grpc-header-forward-pattern={CLIENT_ADDRESS_PARAMETER}"]
    with TritonServer(repository, forward, log_path=log, admin_key=ADMIN_KEY) as triton:
        yield triton


@pytest.fixture(scope="module")
def api(server):
    """The API over that server, trusting 10.9.0.0/16 without a key (X-Forwarded-For from the test,
    on loopback, names the client as the front door would)."""
    env = {"TRITON_API_TRUSTED_NETWORKS": "10.9.0.0/16", "TRITON_ADMIN_KEY": ADMIN_KEY}
    with ApiProcess(server.grpc_url, ["--triton-model", MODEL], env=env) as process:
        yield process


def post(api, path: str, body: dict | None, headers: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        api.url + path, data=data, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def keyed(address: str = "10.3.0.1", key: str = ADMIN_KEY) -> dict:
    return {"triton-admin-key": key, "X-Forwarded-For": address}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def trainer_rank0(port: int, group_name: str, tensors: dict, per_tensor_ready, done) -> None:
    """The trainer's rank 0, in a process of its own, opening the group as SGLang's
    init_custom_process_group does (AReaL's and SkyRL's copies of it) and broadcasting each tensor;
    with `per_tensor_ready`, one tensor per event set (SkyRL posts one request per tensor first)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world, rank, [], Backend("gloo"), PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    for tensor in tensors.values():
        if per_tensor_ready is not None:
            per_tensor_ready.get(timeout=GROUP_TIMEOUT_S)
        dist.broadcast(tensor, 0, group=group)
    done.put("sent")


class Trainer:
    """trainer_rank0 in a spawned process (torch.distributed keeps one group per name per process)."""

    def __init__(self, port: int, group_name: str, tensors: dict, per_tensor: bool = False):
        context = multiprocessing.get_context("spawn")
        self.ready = context.Queue() if per_tensor else None
        self.done = context.Queue()
        self.process = context.Process(target=trainer_rank0, args=(port, group_name, tensors, self.ready, self.done))
        self.process.start()

    def finish(self) -> None:
        assert self.done.get(timeout=GROUP_TIMEOUT_S * 2) == "sent"
        self.process.join(30)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


def in_thread(call):
    """Run `call()` in a thread (an HTTP request that returns once the trainer has broadcast)."""
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", call()), daemon=True)
    thread.start()
    return thread, box


def test_areal_syncs_weights_over_gloo_and_from_disk_through_the_api(server, api, weights_root):
    port = free_port()
    new = {name: t.detach().clone() for name, t in moved_model(SEEDS["step1"]).state_dict().items()}
    trainer = Trainer(port, "update_weight_group", new)
    try:
        # areal/engine/sglang_remote.py: build_init_weights_group_request, build_distributed_weight_update_requests
        init = {
            "master_address": "127.0.0.1",
            "master_port": str(port),
            "rank_offset": 1,
            "world_size": 2,
            "backend": "gloo",
            "group_name": "update_weight_group",
        }
        thread, box = in_thread(lambda: post(api, "/init_weights_update_group", init, keyed()))
        thread.join(GROUP_TIMEOUT_S * 2)
        assert box["value"][0] == 200 and box["value"][1]["success"] is True, box
        update = {
            "names": list(new),
            "dtypes": [str(t.dtype).split("torch.")[1] for t in new.values()],
            "shapes": [list(t.shape) for t in new.values()],
            "group_name": "update_weight_group",
            "abort_all_requests": True,
        }
        status, body = post(api, "/update_weights_from_distributed", update, keyed())
        trainer.finish()
        assert status == 200 and body["success"] is True and body["tensors"] == len(new), body
    finally:
        trainer.stop()
    with GenerateClient(server.grpc_url, model_name=MODEL, admin_key=ADMIN_KEY) as client:
        version = client.get_weight_version()[server.grpc_url]
        assert_replayed_as(client, "step1", version)
        # build_disk_weight_update_requests: an absolute path (inside the weights root) and abort
        status, body = post(
            api,
            "/update_weights_from_disk",
            {"model_path": str(weights_root / "step2"), "abort_all_requests": True},
            keyed(),
        )
        assert status == 200 and body["success"] is True and body["num_paused_requests"] == 0, body
        assert_replayed_as(client, "step2", client.get_weight_version()[server.grpc_url])
    # get_offload_request / get_onload_request: on CPU, nothing to release, said so
    for path, body in (("/release_memory_occupation", {}), ("/resume_memory_occupation", {"tags": ["weights"]})):
        status, answer = post(api, path, body, keyed())
        assert status == 200 and answer["success"] is True and "cpu" in answer["message"], answer
    status, body = post(api, "/destroy_weights_update_group", {"group_name": "update_weight_group"}, keyed())
    assert status == 200 and body["success"] is True


def assert_replayed_as(client, weights: str, version: str) -> None:
    """Tokens on the `weights` of SEEDS, tagged `version` (a distributed update without a version
    is tagged with the update's count)."""
    results = generate(client)
    assert all(set(r.weight_version) == {version} for r in results)
    for r in results:
        r.weight_version = np.array([weights] * len(r.output_ids), dtype=object)
    assert_replayed(results, weights)


def test_skyrl_syncs_one_tensor_per_request_without_a_key_from_a_trusted_network(server, api):
    port = free_port()
    new = {name: t.detach().clone() for name, t in moved_model(SEEDS["step2"]).state_dict().items()}
    trusted = {"X-Forwarded-For": "10.9.4.4"}  # skyrl-train sends no header at all
    trainer = Trainer(port, "skyrl", new, per_tensor=True)
    try:
        # remote_inference_engine.py: RemoteWeightLoader.init_communicator (master_port an int)
        init = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "skyrl",
            "backend": "gloo",
        }
        thread, box = in_thread(lambda: post(api, "/init_weights_update_group", init, trusted))
        thread.join(GROUP_TIMEOUT_S * 2)
        assert box["value"][0] == 200, box
        for name, tensor in new.items():  # load_weights: the request first, then the broadcast
            body = {"name": name, "dtype": str(tensor.dtype).split("torch.")[1], "shape": list(tensor.shape)}
            thread, box = in_thread(lambda body=body: post(api, "/update_weights_from_distributed", body, trusted))
            trainer.ready.put(name)
            thread.join(GROUP_TIMEOUT_S)
            assert box["value"][0] == 200 and box["value"][1]["success"] is True, (name, box)
        trainer.finish()
    finally:
        trainer.stop()
    with GenerateClient(server.grpc_url, model_name=MODEL, admin_key=ADMIN_KEY) as client:
        assert_replayed_as(client, "step2", client.get_weight_version()[server.grpc_url])
    # teardown / sleep / wake_up as RemoteInferenceEngine posts them: no body, {"level": 1}, {"tags": 1}
    assert post(api, "/destroy_weights_update_group", None, trusted)[0] == 200
    for path, body in (("/sleep", {"level": 1}), ("/wake_up", {"tags": 1})):
        status, answer = post(api, path, body, trusted)
        assert status == 200 and answer["success"] is True, (path, answer)
    # the same keyless calls from elsewhere are refused, with SGLang's shape
    status, answer = post(api, "/destroy_weights_update_group", None, {"X-Forwarded-For": "10.8.0.1"})
    assert status == 403 and answer["success"] is False


def test_a_refused_abort_update_leaves_the_requests_in_flight_running(server, api):
    with GenerateClient(server.grpc_url, model_name=MODEL, admin_key=ADMIN_KEY) as client:
        before = client.get_weight_version()[server.grpc_url]
        running = client.submit(PROMPTS, PARAMS, 200, ignore_eos=True)
        time.sleep(0.3)
        with pytest.raises(GenerateError, match="NaN"):
            client.update_weights_from_disk("nan", weight_version="never", pause_mode="abort")
        through_api = post(api, "/update_weights_from_disk", {"model_path": "nan", "abort_all_requests": True}, keyed())
        results = running.result(timeout=120)
        assert client.busy_refusals == 0, "a refused update aborted requests in flight"
    status, body = through_api
    assert status == 400 and body["success"] is False and "NaN" in body["message"], body
    assert all(list(r.weight_version) == [before] * 200 for r in results)


def control(server, key: str, address: str):
    """One control request straight to the model's control input, from `address`."""

    async def send():
        connection = GrpcConnection(server.grpc_url, MODEL)
        try:
            command = {"op": "pause_generation", "mode": "in_place"}
            return await connection.control(control_request(command, key, {CLIENT_ADDRESS_PARAMETER: address}))
        finally:
            await connection.close()

    try:
        return asyncio.run(send())
    except GenerateError as error:
        return error


def test_wrong_keys_are_limited_per_address_across_the_api_and_the_control_input(server, api):
    refused = [
        post(api, "/continue_generation", {}, keyed("10.5.0.1", "w" * 40))[0] for _ in range(3 * WRONG_KEYS_PER_MINUTE)
    ]
    assert refused[: WRONG_KEYS_PER_MINUTE + 1] == [403] * (WRONG_KEYS_PER_MINUTE + 1)
    assert set(refused[WRONG_KEYS_PER_MINUTE + 1 :]) == {429}
    status, body = post(api, "/continue_generation", {}, keyed("10.5.0.1"))  # the right key, from there
    assert status == 429 and body["success"] is False and "too many wrong admin keys" in body["message"]
    blocked = control(server, ADMIN_KEY, "10.5.0.1")  # and on the control input itself
    assert isinstance(blocked, GenerateError) and "too many wrong admin keys" in blocked.message
    assert post(api, "/continue_generation", {}, keyed("10.5.0.2"))[0] == 200  # another address is not

    answers = [control(server, "w" * 40, "10.6.0.1") for _ in range(3 * WRONG_KEYS_PER_MINUTE)]
    messages = [a.message for a in answers]
    assert all("wrong admin key" in m for m in messages[: WRONG_KEYS_PER_MINUTE + 1]), messages
    assert all("too many wrong admin keys" in m for m in messages[WRONG_KEYS_PER_MINUTE + 1 :]), messages
    assert post(api, "/continue_generation", {}, keyed("10.6.0.1"))[0] == 429  # blocked on the API too
    assert control(server, ADMIN_KEY, "10.6.0.2")["paused"] is True
    assert post(api, "/continue_generation", {}, keyed("10.6.0.2"))[0] == 200


def test_the_version_routes_answer_in_sglangs_shape(server, api):
    status, body = post(
        api, "/update_weight_version", {"new_version": "relabelled", "abort_all_requests": False}, keyed()
    )
    assert status == 200 and body == {
        "success": True,
        "message": "Weight version updated to relabelled",
        "new_version": "relabelled",
    }
    assert api.get("/get_weight_version") == (200, {"weight_version": "relabelled"})
    status, body = post(api, "/pause_generation", {"mode": "in_place"}, keyed())
    assert status == 200 and body["status"] == "ok" and body["success"] is True
    assert post(api, "/continue_generation", {"torch_empty_cache": True}, keyed())[0] == 200


def test_the_front_doors_address_header_wins_over_one_the_client_wrote(server, api):
    """What the door sets as a gRPC header reaches the model after the request's own parameters:
    a client blocked at 10.6.0.1 (above) cannot name another address itself, nor hide its own."""
    import queue

    import tritonclient.grpc as grpcclient

    def through_door(door_address: str, written: str | None) -> str:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        answers = queue.Queue()
        client.start_stream(
            lambda result, error: answers.put(error or result), headers={CLIENT_ADDRESS_PARAMETER: door_address}
        )
        try:
            wire = control_request({"op": "pause_generation", "mode": "in_place"}, ADMIN_KEY)
            control = grpcclient.InferInput("control", [1, 1], "BYTES")
            control.set_data_from_numpy(wire.inputs["control"][0])
            parameters = {**wire.parameters, **({CLIENT_ADDRESS_PARAMETER: written} if written else {})}
            client.async_stream_infer(MODEL, [control], parameters=parameters)
            answer = answers.get(timeout=60)
        finally:
            client.stop_stream()
            client.close()
        return str(answer) if not hasattr(answer, "as_numpy") else "answered"

    assert "too many wrong admin keys" in through_door("10.6.0.1", "10.7.7.7")
    assert through_door("10.7.7.7", "10.6.0.1") == "answered"
    assert post(api, "/continue_generation", {}, keyed("10.7.7.7"))[0] == 200
