"""Reading what a model's config.pbtxt declares: logits dtype, output widths, file names in messages."""

from __future__ import annotations

import pytest
import torch

from triton_sampling_mask.model_config import config_path, input_dtype
from triton_sampling_mask.serving.deployment import LOGITS_DATA_TYPES, declared_outputs


def config(logits_type="TYPE_FP32", support_width=8):
    outputs = [{"name": "sampling_mask", "dims": [8]}, {"name": "output_ids", "dims": [1]}]
    if support_width:
        outputs.append({"name": "sampling_mask_logprobs", "dims": [support_width]})
    return {"input": [{"name": "logits", "data_type": logits_type, "dims": [-1]}], "output": outputs}


@pytest.mark.parametrize(
    "data_type, dtype", [("TYPE_FP32", torch.float32), ("TYPE_BF16", torch.bfloat16), ("TYPE_FP16", torch.float16)]
)
def test_logits_dtype_comes_from_the_config(data_type, dtype):
    assert input_dtype(config(data_type), "logits", LOGITS_DATA_TYPES) is dtype


def test_other_logits_dtypes_fail_model_load_naming_the_choices():
    with pytest.raises(ValueError, match="'logits' must be one of TYPE_FP32, TYPE_BF16, TYPE_FP16, got TYPE_INT32"):
        input_dtype(config("TYPE_INT32"), "logits", LOGITS_DATA_TYPES)


def test_per_support_logprobs_must_have_the_mask_width():
    assert "sampling_mask_logprobs" in declared_outputs(config(), 8, "sampler/config.pbtxt")
    assert "sampling_mask_logprobs" not in declared_outputs(config(support_width=0), 8, "sampler/config.pbtxt")
    with pytest.raises(ValueError, match="'sampling_mask_logprobs' in sampler/config.pbtxt must have the width"):
        declared_outputs(config(support_width=16), 8, "sampler/config.pbtxt")


def test_messages_name_the_config_relative_to_the_repository():
    args = {"model_repository": "/srv/secret/place/model_repository/sampler", "model_name": "sampler"}
    assert config_path(args) == "sampler/config.pbtxt"
    assert config_path({"model_name": "generate"}) == "generate/config.pbtxt"
