"""The input table's wire helpers (`sampling.inputs`): `config_data_type` and the generate
client's `generate_wire_inputs`, against what both models' config.pbtxt declare (read from
model_repository/, with the Triton type names written out here, not taken from the table)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from triton_sampling_mask.model_config import dims, read_config_file
from triton_sampling_mask.sampling import inputs

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
# config.pbtxt data_type -> (numpy dtype, Triton's wire datatype), as Triton defines them.
CONFIG_TYPES = {
    "TYPE_FP32": (np.float32, "FP32"),
    "TYPE_FP16": (np.float16, "FP16"),
    "TYPE_INT32": (np.int32, "INT32"),
    "TYPE_UINT64": (np.uint64, "UINT64"),
    "TYPE_BOOL": (np.bool_, "BOOL"),
    "TYPE_STRING": (np.object_, "BYTES"),  # BYTES on the wire, TYPE_STRING in a config
}


def declared_inputs(model: str) -> dict[str, tuple[str, list[int]]]:
    config = read_config_file(REPOSITORY / model / "config.pbtxt")
    return {entry["name"]: (entry["data_type"], dims(entry)) for entry in config["input"]}


@pytest.mark.parametrize("config_type", sorted(CONFIG_TYPES))
def test_config_data_type_names_each_dtype_as_a_config_does(config_type):
    dtype, _ = CONFIG_TYPES[config_type]
    assert inputs.config_data_type(dtype) == config_type
    assert inputs.config_data_type(np.dtype(dtype)) == config_type


@pytest.mark.parametrize("model", ["sampler", "generate"])
def test_config_data_type_of_every_input_is_its_declared_data_type(model):
    found = declared_inputs(model)
    assert {spec.name: inputs.config_data_type(spec.dtype) for spec in inputs.MODEL_INPUTS[model]} == {
        name: data_type for name, (data_type, _) in found.items()
    }


# One generate request as the client builds it: lists for the ragged inputs, Python and numpy scalars.
REQUEST = {
    "input_ids": [3, 1, 4, 1, 5, 9, 2],
    "max_new_tokens": 16,
    "stop_token_ids": [2, 7],
    "ignore_eos": True,
    "stream": False,
    "temperature": 0.7,
    "top_k": np.int64(40),
    "top_p": np.float32(0.9),
    "min_p": 0.05,
    "seed": 2**64 - 3,
    "return_sampling_mask": np.bool_(True),
    "control": '{"command": "pause"}',
}


def test_generate_wire_inputs_give_each_input_its_declared_dtype_and_batch_shape():
    assert set(REQUEST) == set(declared_inputs("generate"))  # every generate input, once
    wire = inputs.generate_wire_inputs(REQUEST)
    assert set(wire) == set(REQUEST)
    for name, (data_type, input_dims) in declared_inputs("generate").items():
        array, datatype = wire[name]
        dtype, expected_datatype = CONFIG_TYPES[data_type]
        assert isinstance(array, np.ndarray), name
        assert datatype == expected_datatype, name
        assert array.dtype == np.dtype(dtype), name
        value = REQUEST[name]
        length = len(value) if isinstance(value, list) else 1
        assert input_dims == ([-1] if isinstance(value, list) else [1]), name
        assert array.shape == (1, length), name  # the batch dimension, then the input's own
        np.testing.assert_array_equal(array[0], np.asarray(value, dtype).reshape(-1), err_msg=name)


def test_generate_wire_inputs_keep_exact_values_and_a_one_token_list_two_dimensional():
    wire = inputs.generate_wire_inputs({"input_ids": [11], "seed": 2**64 - 1, "temperature": 0.1})
    ids, _ = wire["input_ids"]
    assert ids.shape == (1, 1) and ids.dtype == np.int32 and int(ids[0, 0]) == 11
    seed, _ = wire["seed"]
    assert seed.dtype == np.uint64 and int(seed[0, 0]) == 2**64 - 1  # every bit of the seed
    temperature, _ = wire["temperature"]
    assert temperature.dtype == np.float32 and temperature[0, 0] == np.float32(0.1)
    assert inputs.generate_wire_inputs({}) == {}
