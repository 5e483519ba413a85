"""Logits in the engine's own dtype through the real server: a deployment that declares BF16
logits (the one-line config.pbtxt change, served here as `sampler_bf16`) samples them as sent,
over HTTP and gRPC, with the same semantics as FP32."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from testbed.server import OUTPUTS, sampler_inputs
from tests.reference import reference_row


def bf16_inputs(module, logits_bf16: np.ndarray, **params) -> list:
    """sampler_inputs with the logits replaced by a BF16 tensor (tritonclient takes ml_dtypes)."""
    inputs = sampler_inputs(module, np.zeros(logits_bf16.shape, np.float32), **params)
    inputs[0] = module.InferInput("logits", list(logits_bf16.shape), "BF16")
    inputs[0].set_data_from_numpy(logits_bf16)
    return inputs


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_bf16_logits_are_sampled_as_sent(http_client, grpc_client, module):
    client = http_client if module is httpclient else grpc_client
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((6, 4000)) * 3).astype(ml_dtypes.bfloat16)  # bf16: many exact ties
    params = dict(
        temperature=0.8, top_k=[1, 16, 64, 200, 512, 40], top_p=0.9, seed=np.arange(6) + 7, return_sampling_mask=True
    )
    result = client.infer("sampler_bf16", bf16_inputs(module, logits, **params))
    out = {name: result.as_numpy(name) for name in OUTPUTS}
    as_sent = logits.astype(np.float64)  # the values the server ranks, exactly
    for row, top_k in enumerate(params["top_k"]):
        ref = reference_row(as_sent[row], 0.8, top_k, 0.9, tolerance=1e-5)
        length = int(out["sampling_mask_len"][row, 0])
        assert ref.support_min <= length <= ref.support_max
        np.testing.assert_array_equal(out["sampling_mask"][row, :length], ref.order[:length])  # ties: lower id first
        token = int(out["output_ids"][row, 0])
        assert token in ref.order[:length]
        assert out["output_logprobs"][row, 0] == pytest.approx(ref.logprobs[token], abs=1e-4)
        assert out["sampling_logprobs"][row, 0] == pytest.approx(ref.renormalised_logprob(token, length), abs=1e-5)
    # The same rows as FP32 (the bf16 values widened) give the same answers on the FP32 model.
    widened = client.infer("sampler", sampler_inputs(module, logits.astype(np.float32), **params))
    for name in ("output_ids", "sampling_mask", "sampling_mask_len"):
        np.testing.assert_array_equal(widened.as_numpy(name), out[name])


def test_fp32_logits_on_a_bf16_deployment_are_refused_naming_logits(http_client):
    logits = np.zeros((1, 100), np.float32)
    with pytest.raises(InferenceServerException) as error:
        http_client.infer("sampler_bf16", sampler_inputs(httpclient, logits, top_k=5))
    assert error.value.status() == "400" and "logits" in error.value.message()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_client_sends_logits_in_the_deployments_dtype(triton_server, protocol):
    from triton_sampling_mask.client import SamplerClient
    from triton_sampling_mask.client.sampling_params import SamplingParams

    url = triton_server.http_url if protocol == "http" else triton_server.grpc_url
    logits = (np.random.default_rng(12).standard_normal((3, 2000)) * 3).astype(np.float32)
    params = SamplingParams(temperature=0.7, top_k=32, seed=5, return_sampling_mask=True)
    with SamplerClient(url, protocol=protocol, model_name="sampler_bf16") as client:
        assert client.server_limits().logits_datatype == "BF16"
        on_bf16 = client.sample(logits, params)  # float32 in, BF16 on the wire (half the bytes)
    rounded = logits.astype(ml_dtypes.bfloat16).astype(np.float32)
    with SamplerClient(url, protocol=protocol) as client:
        on_fp32 = client.sample(rounded, params)
    np.testing.assert_array_equal(on_bf16.output_ids, on_fp32.output_ids)
    np.testing.assert_array_equal(on_bf16.sampling_mask, on_fp32.sampling_mask)
