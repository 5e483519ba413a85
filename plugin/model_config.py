"""Reading what a model's config.pbtxt says, as the JSON dict Triton itself uses.

A model config reaches the package three ways, all as that one dict shape: inside the server, the
JSON Triton hands to `initialize` (`load_model_config`); over the wire, the JSON of Triton's model
config endpoint (the clients); and from a model repository on disk, `read_config_file`, the one
reader of config.pbtxt files (protobuf text format with Triton's own `ModelConfig` message, from
tritonclient[grpc]: imported when a file is read, so the stubs never need it). The accessors below
read any of them. No torch here: `ops` reads configs too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def load_model_config(args: dict) -> dict:
    """The model config dict from the `args` of `TritonPythonModel.initialize`."""
    return json.loads(args["model_config"])


def parse_config_text(text: str) -> dict:
    """A config.pbtxt text as Triton's JSON dict (enums by name, e.g. "TYPE_FP32"; fields at their
    default left out, as Triton's JSON does). A malformed text raises ValueError."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    try:
        message = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise ValueError(f"not a model config: {exc}") from None
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def read_config_file(path: str | Path) -> dict:
    """A model's config.pbtxt on disk as Triton's JSON dict (see `parse_config_text`)."""
    try:
        return parse_config_text(Path(path).read_text())
    except ValueError as exc:
        raise ValueError(f"{Path(path).parent.name}/config.pbtxt: {exc}") from None


def dims(entry: dict) -> list[int]:
    """An input's or output's dims as integers (the gRPC JSON spells 64-bit integers as strings)."""
    return [int(d) for d in entry.get("dims", [])]


def entries(model_config: dict, kind: str) -> dict[str, dict]:
    """The `input` or `output` entries of a config, by name."""
    return {entry["name"]: entry for entry in model_config.get(kind, [])}


def is_decoupled(model_config: dict) -> bool:
    """Whether the model may send several responses per request (model_transaction_policy)."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def string_parameters(model_config: dict) -> dict[str, str]:
    """Every `parameters` entry of a config, key -> string value."""
    return {key: str(value.get("string_value", "")) for key, value in model_config.get("parameters", {}).items()}


def output_width(model_config: dict, output_name: str) -> int:
    """The last (fixed) dimension of an output: the mask width W lives only in config.pbtxt."""
    for output in model_config.get("output", []):
        if output["name"] == output_name:
            width = dims(output)[-1]
            if width < 1:
                raise ValueError(f"output {output_name!r} must have a fixed positive last dimension, got {width}")
            return width
    raise ValueError(f"config.pbtxt declares no output named {output_name!r}")


def input_dtype(model_config: dict, input_name: str, choices: dict):
    """`choices[data_type]` for an input's declared data_type (e.g. a torch dtype); anything else
    fails model load naming the input and the accepted types."""
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


def config_path(args: dict) -> str:
    """This model's config.pbtxt relative to the model repository ("sampler/config.pbtxt"), for
    messages that tell users what to edit without showing clients the server's file system."""
    repository = args.get("model_repository")
    model_directory = (
        os.path.basename(os.path.normpath(repository)) if repository else args.get("model_name", "<model>")
    )
    return f"{model_directory}/config.pbtxt"
