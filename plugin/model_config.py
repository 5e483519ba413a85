"""Reading what a model's config.pbtxt says (as the JSON Triton hands to `initialize`)."""

from __future__ import annotations

import json
import os

import torch


def load_model_config(args: dict) -> dict:
    """The model config dict from the `args` of `TritonPythonModel.initialize`."""
    return json.loads(args["model_config"])


def output_width(model_config: dict, output_name: str) -> int:
    """The last (fixed) dimension of an output: the mask width W lives only in config.pbtxt."""
    for output in model_config.get("output", []):
        if output["name"] == output_name:
            width = int(output["dims"][-1])
            if width < 1:
                raise ValueError(f"output {output_name!r} must have a fixed positive last dimension, got {width}")
            return width
    raise ValueError(f"config.pbtxt declares no output named {output_name!r}")


# The logits dtypes a deployment may declare (config.pbtxt data_type -> torch dtype).
LOGITS_DATA_TYPES = {"TYPE_FP32": torch.float32, "TYPE_BF16": torch.bfloat16, "TYPE_FP16": torch.float16}


def input_dtype(model_config: dict, input_name: str, choices: dict) -> torch.dtype:
    """The torch dtype of an input's declared data_type, one of `choices`; anything else fails
    model load naming the input and the accepted types."""
    for entry in model_config.get("input", []):
        if entry["name"] == input_name:
            data_type = entry["data_type"]
            if data_type not in choices:
                raise ValueError(f"input {input_name!r} must be one of {', '.join(choices)}, got {data_type}")
            return choices[data_type]
    raise ValueError(f"config.pbtxt declares no input named {input_name!r}")


def string_parameter(model_config: dict, key: str, default: str) -> str:
    """A `parameters { key: ... value: { string_value: ... } }` entry, or `default`."""
    entry = model_config.get("parameters", {}).get(key)
    if entry is None:
        return default
    return str(entry.get("string_value", default)).strip()


def int_parameter(model_config: dict, key: str, default: int) -> int:
    """An integer-valued config parameter; a malformed value fails model load, naming the key."""
    raw = string_parameter(model_config, key, str(default))
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"config parameter {key!r} must be an integer, got {raw!r}") from exc


def instance_device(args: dict) -> torch.device:
    """cuda:<model_instance_device_id> for KIND_GPU instances, else the CPU (Triton pins nothing)."""
    if args.get("model_instance_kind") == "GPU":
        return torch.device(f"cuda:{int(args.get('model_instance_device_id', 0))}")
    return torch.device("cpu")


def config_path(args: dict) -> str:
    """This model's config.pbtxt relative to the model repository ("sampler/config.pbtxt"), for
    messages that tell users what to edit without showing clients the server's file system."""
    repository = args.get("model_repository")
    model_directory = (
        os.path.basename(os.path.normpath(repository)) if repository else args.get("model_name", "<model>")
    )
    return f"{model_directory}/config.pbtxt"
