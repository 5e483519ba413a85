"""The GPU deployment's logic, exercised on whatever device this machine has (CPU here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from testbed.server import MODEL_REPOSITORY
from triton_sampling_mask.model_config import parse_config_text, read_config_file
from triton_sampling_mask.ops.gpu_repository import build_gpu_repository, gpu_config_text
from triton_sampling_mask.serving.deployment import instance_device
from triton_sampling_mask.serving.triton_io import input_to_numpy, input_to_torch, read_params

DEVICE = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def test_gpu_config_changes_only_the_instance_kind_and_input_placement(tmp_path):
    cpu_text = (MODEL_REPOSITORY / "sampler" / "config.pbtxt").read_text()
    gpu_dir = build_gpu_repository(MODEL_REPOSITORY, tmp_path / "gpu")
    gpu = read_config_file(gpu_dir / "sampler" / "config.pbtxt")
    cpu = parse_config_text(cpu_text)

    assert [g["kind"] for g in gpu["instance_group"]] == ["KIND_GPU"]
    assert gpu["parameters"]["FORCE_CPU_ONLY_INPUT_TENSORS"]["string_value"] == "no"
    assert (gpu_dir / "sampler" / "1" / "model.py").read_bytes() == (
        MODEL_REPOSITORY / "sampler" / "1" / "model.py"
    ).read_bytes()
    # Everything else, the mask width W included, is the CPU config's.
    del gpu["instance_group"], cpu["instance_group"]
    del gpu["parameters"]["FORCE_CPU_ONLY_INPUT_TENSORS"]
    assert gpu == cpu
    assert gpu_config_text(gpu_config_text(cpu_text)) == gpu_config_text(cpu_text)  # idempotent


def test_gpu_config_adds_missing_blocks():
    config = parse_config_text(gpu_config_text('name: "m"\nbackend: "python"\n'))
    assert config["instance_group"][0]["kind"] == "KIND_GPU"
    assert config["parameters"]["FORCE_CPU_ONLY_INPUT_TENSORS"]["string_value"] == "no"


def test_instance_device_follows_the_instance_kind():
    assert instance_device({"model_instance_kind": "GPU", "model_instance_device_id": "3"}) == torch.device("cuda:3")
    assert instance_device({"model_instance_kind": "CPU", "model_instance_device_id": "0"}) == torch.device("cpu")


class DeviceTensor:
    """Stands in for a pb_utils.Tensor that Triton left on a device: only DLPack reads it."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def is_cpu(self) -> bool:
        return False

    def as_numpy(self):
        raise AssertionError("as_numpy is refused for GPU tensors")

    def to_dlpack(self):
        return torch.utils.dlpack.to_dlpack(self.tensor)


@pytest.mark.parametrize(
    "values",
    [
        np.array([[0.5], [2.0]], np.float32),
        np.array([[7], [-1]], np.int32),
        np.array([[2**64 - 1], [3]], np.uint64),
        np.array([[True], [False]]),
    ],
    ids=lambda v: v.dtype.name,
)
def test_device_inputs_are_read_through_dlpack(values):
    tensor = DeviceTensor(torch.from_numpy(values).to(DEVICE))
    np.testing.assert_array_equal(input_to_numpy(tensor), values)
    moved = input_to_torch(tensor, DEVICE)
    assert moved.device == DEVICE
    np.testing.assert_array_equal(moved.cpu().numpy(), values)


class InputsByName:
    """Stands in for pb_utils' input lookup over a dict request (only what read_params calls)."""

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.get(name)


def test_request_parameters_left_on_the_device_are_parsed():
    on_device = lambda array: DeviceTensor(torch.from_numpy(array).to(DEVICE))  # noqa: E731
    request = {
        "temperature": on_device(np.array([[0.5], [0.0]], np.float32)),
        "top_k": on_device(np.array([[4], [1]], np.int32)),
        "seed": on_device(np.array([[2**63 + 5], [1]], np.uint64)),
        "return_sampling_mask": on_device(np.array([[True], [False]])),
    }
    params = read_params(request, InputsByName, 2)
    assert params.temperature.tolist() == [0.5, 0.0]
    assert params.top_k.tolist() == [4, 1]
    assert params.seed.tolist() == [2**63 + 5, 1] and params.has_seed.all()
    assert params.return_sampling_mask.tolist() == [True, False]
    assert params.top_p.tolist() == [1.0, 1.0]  # absent inputs keep their defaults
