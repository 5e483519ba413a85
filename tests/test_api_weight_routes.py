"""The HTTP API's weight routes without a tritonserver (the model's side: client_tests/test_api_weights.py):
the bodies AReaL 1.0.4 and skyrl-train 0.3.1 send (copied from their sources, cited at each) and
SGLang's full request models parsed into the control commands they mean; fields this server cannot
honour refused by name; every answer in SGLang's `{"success", "message"}` shape; the admin key (or a
trusted network) checked before the body; the trusted-network setting both ways."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from testbed.app_thread import app_on_a_thread
from triton_sampling_mask.api.app import create_app
from triton_sampling_mask.api.config import (
    ADMIN_KEY_ENV,
    FORWARDED_ALLOW_IPS_ENV,
    TRUSTED_NETWORKS_ENV,
    ApiConfig,
    build_parser,
    config_from_args,
)
from triton_sampling_mask.api.weight_access import WeightAccess, parse_networks
from triton_sampling_mask.api.weight_schemas import (
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateWeightVersion,
)
from triton_sampling_mask.ops import settings
from triton_sampling_mask.ops.server_process import free_port

ADMIN = "a" * 40

# areal/engine/sglang_remote.py (areal 1.0.4), SGLangBackend.build_*_request: what AReaL posts.
AREAL_INIT = {
    "master_address": "10.0.0.5",
    "master_port": "29500",  # str(meta.nccl_master_port)
    "rank_offset": 1,
    "world_size": 2,
    "backend": "gloo",
    "group_name": "update_weight_group",
}
AREAL_DISTRIBUTED = {
    "names": ["model.norm.weight", "lm_head.weight"],
    "dtypes": ["float32", "bfloat16"],  # str(tensor.dtype).split("torch.")[1]
    "shapes": [[64], [256, 64]],  # tuple(tensor.shape), as JSON
    "group_name": "update_weight_group",
    "abort_all_requests": True,
}
AREAL_DISK = {"model_path": "/ckpt/step-3", "abort_all_requests": True}
# skyrl_train/inference_engines/remote_inference_engine.py (skyrl-train 0.3.1), RemoteWeightLoader
# and RemoteInferenceEngine with engine_backend "sglang".
SKYRL_INIT = {
    "master_address": "10.0.0.7",
    "master_port": 41000,
    "rank_offset": 1,
    "world_size": 2,
    "group_name": "skyrl",
    "backend": "gloo",
}
SKYRL_ONE_TENSOR = {"name": "model.norm.weight", "dtype": "bfloat16", "shape": [64]}
# sglang/srt/managers/io_struct.py (sglang 0.5.23): UpdateWeightFromDiskReqInput at its defaults.
SGLANG_FULL_DISK = {
    "model_path": "step-1",
    "load_format": None,
    "abort_all_requests": False,
    "weight_version": "v1",
    "is_async": False,
    "torch_empty_cache": False,
    "keep_pause": False,
    "recapture_cuda_graph": False,
    "token_step": 0,
    "flush_cache": True,
    "manifest": None,
    "rid": "r-1",
}


def test_arealsbodies_become_the_commands_they_mean():
    init = InitWeightsUpdateGroup.model_validate(AREAL_INIT).command()
    assert init == {"op": "init_weights_update_group", **AREAL_INIT, "master_port": 29500}
    update = UpdateFromDistributed.model_validate(AREAL_DISTRIBUTED).command()
    assert update == {
        "op": "update_weights_from_distributed",
        "tensors": [
            {"name": "model.norm.weight", "dtype": "float32", "shape": [64]},
            {"name": "lm_head.weight", "dtype": "bfloat16", "shape": [256, 64]},
        ],
        "pause_mode": "abort",
        "group_name": "update_weight_group",
    }
    disk = UpdateFromDisk.model_validate(AREAL_DISK).command()
    assert disk == {"op": "update_weights_from_disk", "model_path": "/ckpt/step-3", "pause_mode": "abort"}


def test_skyrls_one_tensor_form_uses_the_open_group():
    update = UpdateFromDistributed.model_validate(SKYRL_ONE_TENSOR).command()
    assert update == {
        "op": "update_weights_from_distributed",
        "tensors": [{"name": "model.norm.weight", "dtype": "bfloat16", "shape": [64]}],
        "pause_mode": "in_place",
    }
    assert InitWeightsUpdateGroup.model_validate(SKYRL_INIT).command()["group_name"] == "skyrl"
    assert DestroyWeightsUpdateGroup.model_validate({}).command() == {"op": "destroy_weights_update_group"}


def test_sglangs_full_disk_request_is_accepted_at_its_defaults():
    request = UpdateFromDisk.model_validate(SGLANG_FULL_DISK)
    assert request.unsupported() == []
    assert request.command() == {
        "op": "update_weights_from_disk",
        "model_path": "step-1",
        "pause_mode": "in_place",
        "weight_version": "v1",
    }
    version = UpdateWeightVersion.model_validate({"new_version": "v2"}).command()
    assert version == {"op": "update_weight_version", "weight_version": "v2", "pause_mode": "abort"}


@pytest.mark.parametrize(
    "field, value",
    [("is_async", True), ("keep_pause", True), ("token_step", 7), ("manifest", {"a": 1}), ("load_format", "gguf")],
)
def test_a_value_this_server_cannot_honour_is_refused_by_name(field, value):
    problems = UpdateFromDisk.model_validate({**SGLANG_FULL_DISK, field: value}).unsupported()
    assert len(problems) == 1 and problems[0].startswith(field)


@pytest.fixture(scope="module")
def api():
    """An API whose model cannot be reached, trusting 10.1.0.0/16 (X-Forwarded-For from loopback
    names the client, as from the front door)."""
    unreachable = f"127.0.0.1:{free_port()}"
    config = ApiConfig(
        triton_url=unreachable, max_body_bytes=4000, admin_key=ADMIN, trusted_networks=parse_networks("10.1.0.0/16")
    )
    with app_on_a_thread(create_app(config)) as url:
        yield url


def post(url: str, body: object, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


ROUTES = [
    "/update_weights_from_disk",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weight_version",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/sleep",
    "/wake_up",
    "/pause_generation",
    "/continue_generation",
]


@pytest.mark.parametrize("path", ROUTES)
def test_a_keyless_call_from_an_untrusted_address_is_a_403_before_its_body_is_read(api, path):
    status, body = post(api + path, b"not json")
    assert status == 403 and body["success"] is False and "admin key" in body["message"], body


def test_a_bad_pause_mode_without_a_key_is_a_403_and_with_one_a_400_naming_it(api):
    """Was a 500 'internal error: ValueError'."""
    status, body = post(api + "/update_weights_from_disk", {"model_path": "x", "pause_mode": "x"})
    assert status == 403 and body["success"] is False
    status, body = post(
        api + "/update_weights_from_disk", {"model_path": "x", "pause_mode": "x"}, {"triton-admin-key": ADMIN}
    )
    assert status == 400 and body["success"] is False and body["message"].startswith("pause_mode"), body


@pytest.mark.parametrize(
    "path, payload, words",
    [
        ("/update_weights_from_disk", {**SGLANG_FULL_DISK, "is_async": True}, "is_async"),
        ("/update_weights_from_disk", {"model_path": "x", "unknown": 1}, "unknown field 'unknown'"),
        ("/update_weights_from_distributed", {**SKYRL_ONE_TENSOR, "names": ["a"]}, "not both"),
        ("/update_weights_from_distributed", {**AREAL_DISTRIBUTED, "shapes": [[64]]}, "one entry per tensor"),
        ("/update_weights_from_distributed", {**AREAL_DISTRIBUTED, "selector": "draft"}, "no draft model"),
        ("/init_weights_update_group", {**AREAL_INIT, "master_port": "port"}, "master_port"),
        ("/pause_generation", {"mode": "retract"}, "retract"),
        ("/sleep", {"level": 3}, "level"),
    ],
)
def test_refusals_are_400s_in_sglangs_shape_naming_the_field(api, path, payload, words):
    status, body = post(api + path, payload, {"triton-admin-key": ADMIN})
    assert status == 400 and body["success"] is False and words in body["message"], body


def test_a_trusted_network_calls_without_a_key_and_others_cannot(api):
    """The model is unreachable here: a call let through is a 503, a refused one a 403."""
    for address, status in (("10.1.2.3", 503), ("10.2.0.1", 403), ("127.0.0.1", 403)):
        got, body = post(api + "/continue_generation", {}, {"X-Forwarded-For": address})
        assert got == status and body["success"] is False, (address, body)
    # the front door appends the address it saw: one the client wrote before it is not believed
    got, _ = post(api + "/continue_generation", {}, {"X-Forwarded-For": "10.1.2.3, 192.0.2.9"})
    assert got == 403


def test_the_trusted_networks_are_off_by_default_and_need_the_admin_key(monkeypatch, tmp_path):
    for name in (TRUSTED_NETWORKS_ENV, ADMIN_KEY_ENV, FORWARDED_ALLOW_IPS_ENV):
        monkeypatch.delenv(name, raising=False)
    base = ["--triton-url", "127.0.0.1:1"]
    config = config_from_args(build_parser().parse_args(base))
    assert config.trusted_networks == () and config.admin_key is None
    monkeypatch.setenv(TRUSTED_NETWORKS_ENV, "10.0.0.0/8, 192.168.1.7")
    with pytest.raises(ValueError, match="needs the admin key"):
        config_from_args(build_parser().parse_args(base))
    (tmp_path / "key").write_text(ADMIN + "\n")
    config = config_from_args(build_parser().parse_args([*base, "--admin-key-file", str(tmp_path / "key")]))
    assert config.admin_key == ADMIN and [str(n) for n in config.trusted_networks] == ["10.0.0.0/8", "192.168.1.7/32"]
    monkeypatch.setenv(TRUSTED_NETWORKS_ENV, "10.0.0.0/33")
    with pytest.raises(ValueError, match="not an IP network"):
        config_from_args(build_parser().parse_args(base))


def test_the_apis_variables_are_settings():
    for name in (TRUSTED_NETWORKS_ENV, ADMIN_KEY_ENV, FORWARDED_ALLOW_IPS_ENV):
        assert name in settings.SETTINGS
    assert settings.TRITON_API_FORWARDED_ALLOW_IPS.default == "127.0.0.1"


def test_a_sent_key_is_passed_on_even_from_a_trusted_network():
    """A wrong key from a trusted network is the model's to refuse (and count), not replaced."""

    class Raw:
        def __init__(self, headers, host):
            self.headers, self.client = headers, type("Client", (), {"host": host})()

    access = WeightAccess(None, ADMIN, parse_networks("10.0.0.0/8"))
    assert access.key_for(Raw({"triton-admin-key": "mine"}, "10.0.0.1")) == "mine"
    assert access.key_for(Raw({}, "10.0.0.1")) == ADMIN
    assert access.key_for(Raw({}, "::ffff:10.0.0.1")) == ADMIN
    assert access.key_for(Raw({}, "11.0.0.1")) is None
