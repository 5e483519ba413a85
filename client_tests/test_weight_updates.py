"""Weight updates through a real tritonserver of its own: control requests to the `generate` model
(float64 LM, an admin key, a weights root), the version on every token, refusals that leave the
old weights answering, pause / continue, and the RL loop example (disk and gloo updates).
"""

from __future__ import annotations

import json
import re
import runpy
import time

import numpy as np
import pytest

from testbed.server import REPO_ROOT, ExternalTritonServer, TritonServer
from tests.reference import reference_row
from tests.weights_fixtures import moved_model, replay_logits, replay_model
from triton_sampling_mask.client import GenerateClient, GenerateError
from triton_sampling_mask.client.sampling_params import SamplingParams

from .test_generate_engine import build_engine_repository

MODEL = "generate_weights"
ADMIN_KEY = "weights-test-key"
PARAMS = SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=3, return_sampling_mask=True)
PROMPTS = [[5, 6, 7], [40, 41, 42, 43]]
SEEDS = {"default": None, "step1": 21, "step2": 22}  # version -> moved_model seed (None: the shipped LM)
SECRET = "model-type-from-outside-the-root"
# checkpoint under the root -> (its file that links out of the root, the file that link names there)
LINKED = {
    "linked_shard": ("model.safetensors", "ckpt/model.safetensors"),
    "linked_text": ("config.json", "passwd"),
    "linked_json": ("config.json", "config.json"),
}


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights_root")
    for version, seed in SEEDS.items():
        if seed is not None:
            moved_model(seed).save_pretrained(root / version)
    broken = root / "nan"
    moved_model(23).save_pretrained(broken)
    from safetensors.torch import load_file, save_file

    tensors = load_file(broken / "model.safetensors")
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, broken / "model.safetensors")
    # Links out of the root, to files a trainer must never get loaded or read back.
    outside = tmp_path_factory.mktemp("outside_the_root")
    moved_model(24).save_pretrained(outside / "ckpt")
    (outside / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (outside / "config.json").write_text(json.dumps({"model_type": SECRET, "architectures": [SECRET]}))
    for name, (file, target) in LINKED.items():
        moved_model(25).save_pretrained(root / name)
        (root / name / file).unlink()
        (root / name / file).symlink_to(outside / target)
    return root


@pytest.fixture(scope="module")
def weights_server(tmp_path_factory, weights_root):
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("starts a local CPU tritonserver with a weights root and an admin key of its own")
    variant = {MODEL: {"lm_dtype": "float64", "weights_root": str(weights_root)}}
    repository = build_engine_repository(tmp_path_factory.mktemp("weights_models"), variant)
    log = tmp_path_factory.mktemp("weights_logs") / "tritonserver.log"
    with TritonServer(repository, log_path=log, admin_key=ADMIN_KEY) as server:
        yield server


@pytest.fixture(params=["grpc", "http"])
def client(request, weights_server):
    url = weights_server.grpc_url if request.param == "grpc" else weights_server.http_url
    with GenerateClient(url, protocol=request.param, model_name=MODEL, admin_key=ADMIN_KEY) as client:
        yield client


def assert_replayed(results, version: str) -> None:
    """Every token is tagged `version` and its mask and log-prob are the float64 replay's on those weights."""
    model = replay_model(SEEDS[version])
    for prompt, result in zip(PROMPTS, results):
        assert list(result.weight_version) == [version] * len(result.output_ids)
        for i, token in enumerate(result.output_ids):
            ref = reference_row(replay_logits(model, prompt, result.output_ids, i), 0.8, 20, 0.95)
            length = result.sampling_mask_len[i]
            np.testing.assert_array_equal(result.sampling_mask[i, :length], ref.support)
            assert abs(result.output_logprobs[i] - ref.logprobs[token]) < 1e-5


def generate(client, max_new_tokens: int = 6):
    return client.generate(PROMPTS, PARAMS, max_new_tokens, ignore_eos=True)


def test_updates_follow_the_trainer_and_refusals_leave_the_old_weights(client, weights_root):
    (url,) = client.urls
    start = client.get_weight_version()[url]
    with pytest.raises(GenerateError, match="admin_key"):
        with GenerateClient(url, protocol=client.protocol, model_name=MODEL) as keyless:
            keyless.update_weights_from_disk("step1")
    with pytest.raises(GenerateError, match="wrong admin key"):
        client.update_weights_from_disk("step1", admin_key="not-the-key")
    with pytest.raises(GenerateError, match="'model.norm.weight' holds NaN") as refused:
        client.update_weights_from_disk("nan", weight_version="bad")
    with pytest.raises(GenerateError, match="outside the allowed weights root") as outside:
        client.update_weights_from_disk("../")
    for error in (refused.value, outside.value):
        assert str(weights_root) not in error.message
    assert client.get_weight_version()[url] == start
    assert_replayed(generate(client), start)

    target = "step2" if start == "step1" else "step1"
    answer = client.update_weights_from_disk(target, weight_version=target, pause_mode="in_place")
    assert answer[url]["weight_version"] == target and answer[url]["tensors"] > 0
    assert_replayed(generate(client), target)


def test_files_linked_out_of_the_root_are_neither_loaded_nor_read(client, weights_root):
    (url,) = client.urls
    start = client.get_weight_version()[url]
    for name, (file, _) in LINKED.items():
        with pytest.raises(GenerateError) as refused:
            client.update_weights_from_disk(name, weight_version="linked")
        assert refused.value.message.endswith(f"{name}/{file} is outside the allowed weights root")
        assert refused.value.status == ("400" if client.protocol == "http" else "in-band")
        for leak in (str(weights_root), SECRET, "not readable JSON", "root:x"):
            assert leak not in refused.value.message
    with pytest.raises(GenerateError, match="cannot be opened") as odd:
        client.update_weights_from_disk("bad\0name")
    assert odd.value.status == ("400" if client.protocol == "http" else "in-band")
    assert client.get_weight_version()[url] == start
    assert_replayed(generate(client), start)


def test_abort_ends_requests_in_flight_and_the_client_resends_them(weights_server):
    with GenerateClient(weights_server.grpc_url, model_name=MODEL, admin_key=ADMIN_KEY) as client:
        version = "step2" if client.get_weight_version()[weights_server.grpc_url] == "step1" else "step1"
        running = client.submit(PROMPTS, PARAMS, 300, ignore_eos=True)
        time.sleep(0.2)
        client.update_weights_from_disk(version, weight_version=version, pause_mode="abort")
        results = running.result(timeout=120)
        assert client.busy_refusals >= 1, "the aborted requests should have been resent"
    assert all(list(r.weight_version) == [version] * 300 for r in results)


def test_pause_holds_requests_until_continue_on_every_replica(weights_server):
    # Two names of one server: the client sends every control request to each of its replicas.
    urls = [weights_server.grpc_url, weights_server.grpc_url.replace("127.0.0.1", "localhost")]
    with GenerateClient(urls, model_name=MODEL, admin_key=ADMIN_KEY) as client:
        assert [a["paused"] for a in client.pause_generation("in_place").values()] == [True, True]
        held = client.submit(PROMPTS, PARAMS, 4, ignore_eos=True)
        time.sleep(0.5)
        assert not held.done()
        assert [a["paused"] for a in client.continue_generation().values()] == [False, False]
        assert len(held.result(timeout=60)) == 2
        assert list(client.get_weight_version()) == urls


def test_update_from_shared_memory(weights_server):
    model = moved_model(SEEDS["step1"])
    with GenerateClient(weights_server.grpc_url, model_name=MODEL, admin_key=ADMIN_KEY) as client:
        answer = client.update_weights_from_tensor(dict(model.state_dict()), weight_version="step1")
        assert answer[weights_server.grpc_url]["weight_version"] == "step1"
        assert_replayed(generate(client), "step1")


def test_the_rl_loop_example_keeps_ratios_at_one_after_every_update(weights_server, weights_root, monkeypatch, capsys):
    script = REPO_ROOT / "examples" / "rl_loop.py"
    argv = [str(script), "--url", weights_server.grpc_url, "--model", MODEL, "--weights-root", str(weights_root)]
    monkeypatch.setenv("TRITON_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.setattr("sys.argv", argv)
    runpy.run_path(str(script), run_name="__main__")
    worst = [float(x) for x in re.findall(r"max \|ratio - 1\| ([-+.e0-9]+)", capsys.readouterr().out)]
    assert len(worst) == 3 and max(worst) < 1e-5
