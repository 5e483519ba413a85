"""The output table (`sampling.outputs`) is the contract: both models' config.pbtxt declare exactly
its outputs, with its dtypes and dims, and every result type carries its names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from triton_sampling_mask.client.sampler_client import SampleResult
from triton_sampling_mask.sampling import outputs
from triton_sampling_mask.sampling.sampler import SamplingResult

REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
TRITON_TYPES = {np.int32: "TYPE_INT32", np.uint64: "TYPE_UINT64", np.float32: "TYPE_FP32", np.object_: "TYPE_STRING"}


def declared(model: str) -> dict:
    config = text_format.Parse((REPOSITORY / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return {o.name: (model_config_pb2.DataType.Name(o.data_type), list(o.dims)) for o in config.output}


@pytest.mark.parametrize("model", ["sampler", "generate"])
def test_each_config_declares_the_table_outputs_with_their_dtypes_and_dims(model):
    found = declared(model)
    width = found[outputs.SAMPLING_MASK.name][1][-1]
    expected = {spec.name: (TRITON_TYPES[spec.dtype], spec.dims(model, width)) for spec in outputs.MODEL_OUTPUTS[model]}
    assert found == expected


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
