"""The input and output tables (`sampling.inputs`, `sampling.outputs`) are the contract: both
models' config.pbtxt declare exactly their inputs and outputs, with their dtypes and dims, and
every result type carries the output names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from triton_sampling_mask.client.sampler_client import SampleResult
from triton_sampling_mask.model_config import dims, parse_config_text, read_config_file
from triton_sampling_mask.sampling import inputs, outputs
from triton_sampling_mask.sampling.sampler import SamplingResult

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
# Written out here, not derived from the tables' own helpers, so a wrong mapping there fails.
TRITON_TYPES = {np.int32: "TYPE_INT32", np.uint64: "TYPE_UINT64", np.float32: "TYPE_FP32", np.object_: "TYPE_STRING"}
INPUT_TYPES = {**TRITON_TYPES, np.bool_: "TYPE_BOOL"}


def declared(model: str, kind: str = "output") -> dict:
    """name -> (data_type, dims) of a model's inputs or outputs, in config.pbtxt order."""
    config = read_config_file(REPOSITORY / model / "config.pbtxt")
    return {entry["name"]: (entry["data_type"], dims(entry)) for entry in config[kind]}


@pytest.mark.parametrize("model", ["sampler", "generate"])
def test_each_config_declares_the_table_outputs_with_their_dtypes_and_dims(model):
    found = declared(model)
    width = found[outputs.SAMPLING_MASK.name][1][-1]
    expected = {spec.name: (TRITON_TYPES[spec.dtype], spec.dims(model, width)) for spec in outputs.MODEL_OUTPUTS[model]}
    assert found == expected


@pytest.mark.parametrize("model", ["sampler", "generate"])
def test_each_config_declares_the_table_inputs_in_order_with_dtypes_dims_and_flags(model):
    config = read_config_file(REPOSITORY / model / "config.pbtxt")
    found = [
        (e["name"], e["data_type"], dims(e), e.get("optional", False), e.get("allow_ragged_batch", False))
        for e in config["input"]
    ]
    expected = [
        (spec.name, INPUT_TYPES[spec.dtype], spec.dims, spec.optional, spec.ragged)
        for spec in inputs.MODEL_INPUTS[model]
    ]
    assert found == expected
    assert {spec.datatype for spec in inputs.MODEL_INPUTS[model]} <= {"FP32", "INT32", "UINT64", "BOOL", "BYTES"}


def test_every_sampling_parameter_is_an_optional_per_row_input_of_both_models():
    for model in ("sampler", "generate"):
        names = [spec.name for spec in inputs.MODEL_INPUTS[model] if spec in inputs.PARAM_INPUTS]
        assert names == [spec.name for spec in inputs.PARAM_INPUTS] and len(names) >= 6
    assert all(spec.optional and spec.dims == [1] for spec in inputs.PARAM_INPUTS)


def test_the_reader_gives_the_json_triton_gives_the_model():
    config = parse_config_text(
        'name: "m" max_batch_size: 4 input [ { name: "x", data_type: TYPE_FP32, dims: [ -1 ], optional: true } ]'
        ' parameters [ { key: "k", value: { string_value: "v" } } ]  # a comment'
    )
    assert config["max_batch_size"] == 4 and config["parameters"] == {"k": {"string_value": "v"}}
    assert config["input"][0]["data_type"] == "TYPE_FP32" and dims(config["input"][0]) == [-1]
    with pytest.raises(ValueError, match="not a model config"):
        parse_config_text("name: ")


def test_result_types_carry_the_wire_names():
    assert SamplingResult.FIELDS[: len(outputs.TOKEN_OUTPUT_NAMES)] == outputs.TOKEN_OUTPUT_NAMES
    # The client's result: every output both models send, by name, then the receipts built from them.
    names = tuple(f.name for f in dataclasses.fields(SampleResult))
    assert names == (*outputs.SAMPLED_OUTPUT_NAMES, "receipts")


def test_to_wire_casts_and_orders_by_the_table_and_padding_uses_the_fill():
    arrays = {
        name: np.zeros((2, 3) if name in outputs.MASK_OUTPUT_NAMES else 2, np.float64)
        for name in reversed(outputs.TOKEN_OUTPUT_NAMES)
    }
    wire = outputs.to_wire({**arrays, "row_max": np.zeros(2)})
    assert tuple(wire) == outputs.TOKEN_OUTPUT_NAMES
    assert [wire[s.name].dtype for s in outputs.TOKEN_OUTPUTS] == [np.dtype(s.dtype) for s in outputs.TOKEN_OUTPUTS]
    assert (outputs.padding("sampling_mask", 2, 4) == -1).all() and outputs.padding("sampling_mask", 2, 4).shape == (
        2,
        4,
    )
    assert np.isneginf(outputs.padding("sampling_mask_logprobs", 1, 4)).all()
    assert outputs.padding("output_ids", 3, 4).shape == (3,)
