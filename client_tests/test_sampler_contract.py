"""The sampler's contract through a real tritonserver, over HTTP and gRPC."""

from __future__ import annotations

import math

import numpy as np
import pytest

from testbed.server import infer
from tests.reference import reference_row

MASK_WIDTH = 512  # what model_repository/sampler/config.pbtxt declares


def test_model_config_declares_fixed_width_mask_outputs(http_client):
    config = http_client.get_model_config("sampler")
    outputs = {o["name"]: o for o in config["output"]}
    assert outputs["sampling_mask"]["data_type"] == "TYPE_INT32"
    assert outputs["sampling_mask"]["dims"] == [MASK_WIDTH]
    assert outputs["sampling_mask_len"]["dims"] == [1]
    assert outputs["sampling_logprobs"]["data_type"] == "TYPE_FP32"
    inputs = {i["name"]: i for i in config["input"]}
    assert inputs["top_k"]["data_type"] == "TYPE_INT32" and inputs["top_k"]["optional"]
    assert inputs["seed"]["data_type"] == "TYPE_UINT64"
    assert config["max_batch_size"] >= 64 and "dynamic_batching" in config


def test_issue_example(protocol):
    client, module = protocol
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]]))
    out = infer(client, module, "sampler", logits, top_k=3, min_p=0.6, seed=5, return_sampling_mask=True)
    assert out["sampling_mask"].shape == (1, MASK_WIDTH)
    assert out["sampling_mask_len"][0, 0] == 2
    np.testing.assert_array_equal(out["sampling_mask"][0, :2], [0, 1])
    assert (out["sampling_mask"][0, 2:] == -1).all()
    token = int(out["output_ids"][0, 0])
    assert out["sampling_logprobs"][0, 0] == pytest.approx(math.log([0.4, 0.3][token] / 0.7), abs=1e-5)
    assert out["output_logprobs"][0, 0] == pytest.approx(math.log([0.4, 0.3][token]), abs=1e-5)


def test_batch_against_reference(protocol):
    client, module = protocol
    rng = np.random.default_rng(7)
    rows, vocab = 8, 3000
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    params = dict(
        temperature=rng.uniform(0.3, 1.5, rows),
        top_k=rng.integers(1, MASK_WIDTH + 1, rows),
        top_p=rng.uniform(0.5, 1.0, rows),
        min_p=rng.uniform(0.0, 0.1, rows),
        seed=np.arange(rows),
        return_sampling_mask=np.ones(rows, bool),
    )
    out = infer(client, module, "sampler", logits, **params)
    for row in range(rows):
        ref = reference_row(
            logits[row],
            *(float(params[k][row]) for k in ("temperature",)),
            int(params["top_k"][row]),
            float(np.float32(params["top_p"][row])),
            float(np.float32(params["min_p"][row])),
        )
        length = int(out["sampling_mask_len"][row, 0])
        assert ref.support_min <= length <= ref.support_max
        np.testing.assert_array_equal(out["sampling_mask"][row, :length], ref.order[:length])
        token = int(out["output_ids"][row, 0])
        assert token in ref.order[:length]
        assert out["sampling_logprobs"][row, 0] == pytest.approx(ref.renormalised_logprob(token, length), abs=1e-4)


def test_rows_without_mask_report_empty_masks(protocol):
    client, module = protocol
    logits = np.random.default_rng(1).standard_normal((3, 100))
    out = infer(client, module, "sampler", logits, top_k=10, return_sampling_mask=[True, False, True])
    assert out["sampling_mask_len"][1, 0] == 0 and (out["sampling_mask"][1] == -1).all()
    assert out["sampling_mask_len"][0, 0] == 10 and out["sampling_mask_len"][2, 0] == 10


def test_top_p_only_without_mask_samples_normally(protocol):
    client, module = protocol
    logits = np.random.default_rng(2).standard_normal((4, 1000)) * 4
    out = infer(client, module, "sampler", logits, top_p=0.5, seed=np.arange(4))
    for row in range(4):
        ref = reference_row(logits[row].astype(np.float32), top_p=0.5)
        assert int(out["output_ids"][row, 0]) in ref.order[: ref.support_max]


def test_greedy_with_mask(protocol):
    client, module = protocol
    logits = np.array([[0.0, 3.0, 3.0, 1.0]])
    out = infer(client, module, "sampler", logits, temperature=0.0, return_sampling_mask=True)
    assert out["output_ids"][0, 0] == 1
    assert out["sampling_mask_len"][0, 0] == 1 and out["sampling_mask"][0, 0] == 1
    assert out["sampling_logprobs"][0, 0] == 0.0


def test_seeded_tokens_do_not_depend_on_the_mask_flag_or_protocol(http_client, grpc_client):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    logits = np.random.default_rng(3).standard_normal((16, 5000)) * 2
    common = dict(temperature=0.9, top_k=300, top_p=0.95, seed=np.arange(16) + 100)
    with_mask = infer(http_client, httpclient, "sampler", logits, return_sampling_mask=True, **common)
    without = infer(grpc_client, grpcclient, "sampler", logits, return_sampling_mask=False, **common)
    np.testing.assert_array_equal(with_mask["output_ids"], without["output_ids"])
    np.testing.assert_allclose(with_mask["output_logprobs"], without["output_logprobs"], rtol=1e-6)
    # Same rows again, shuffled into a different batch: same tokens row by row.
    order = np.random.default_rng(4).permutation(16)
    shuffled = infer(
        http_client,
        httpclient,
        "sampler",
        logits[order],
        return_sampling_mask=True,
        **{**common, "seed": common["seed"][order]},
    )
    np.testing.assert_array_equal(shuffled["output_ids"], with_mask["output_ids"][order])
