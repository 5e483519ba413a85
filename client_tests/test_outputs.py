"""Outputs through the real server: per-support log-probs (sampler and generate), and only the
outputs a client names are built and sent (checked by the HTTP binary response's size)."""

from __future__ import annotations

import http.client
import json

import numpy as np
import tritonclient.http as httpclient

from testbed.server import infer, sampler_inputs
from tests.reference import reference_row
from triton_sampling_mask.sampling.outputs import WIRE_NEG_INF

from .generate_client import grpc_generate

VOCAB, WIDTH = 3000, 512  # WIDTH: the dims of sampling_mask in model_repository/sampler/config.pbtxt


def test_per_support_logprobs_are_renormalised_over_the_mask(protocol):
    client, module = protocol
    logits = (np.random.default_rng(3).standard_normal((4, VOCAB)) * 2).astype(np.float32)
    params = dict(temperature=0.7, top_k=[1, 20, 300, 64], top_p=0.9, seed=[1, 2, 3, 4])
    params["return_sampling_mask"] = [True, True, True, False]
    out = infer(client, module, "sampler", logits, **params)
    result = client.infer("sampler", sampler_inputs(module, logits, **params))
    support = result.as_numpy("sampling_mask_logprobs")
    assert support.shape == (4, WIDTH) and support.dtype == np.float32
    for row, top_k in enumerate([1, 20, 300, 64]):
        length = int(out["sampling_mask_len"][row, 0])
        assert (support[row, length:] == np.float32(WIRE_NEG_INF)).all()  # JSON has no -inf
        if row == 3:  # no mask asked: nothing but padding
            assert length == 0
            continue
        ids = out["sampling_mask"][row, :length]
        ref = reference_row(logits[row], 0.7, top_k, 0.9, tolerance=1e-5)
        expected = [ref.renormalised_logprob(int(i), length) for i in ids]
        np.testing.assert_allclose(support[row, :length], expected, atol=1e-5, rtol=0)
        assert abs(np.logaddexp.reduce(support[row, :length].astype(np.float64))) < 1e-5
        token = int(out["output_ids"][row, 0])
        assert support[row, list(ids).index(token)] == out["sampling_logprobs"][row, 0]


def raw_binary_infer(url: str, logits: np.ndarray, outputs: list[str] | None) -> tuple[int, dict, bytes]:
    """POST a binary-tensor request naming `outputs` (None: name none); (status, header, body)."""
    rows = logits.shape[0]
    tensors = [
        ("logits", "FP32", logits),
        ("top_k", "INT32", np.full((rows, 1), 8, np.int32)),
        ("return_sampling_mask", "BOOL", np.ones((rows, 1), np.bool_)),
    ]
    header = {
        "inputs": [
            {"name": n, "datatype": d, "shape": list(a.shape), "parameters": {"binary_data_size": a.nbytes}}
            for n, d, a in tensors
        ]
    }
    if outputs is not None:
        header["outputs"] = [{"name": name, "parameters": {"binary_data": True}} for name in outputs]
    else:
        header["parameters"] = {"binary_data_output": True}
    head = json.dumps(header).encode()
    host, port = url.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request(
            "POST",
            "/v2/models/sampler/infer",
            body=head + b"".join(a.tobytes() for _, _, a in tensors),
            headers={"Inference-Header-Content-Length": str(len(head))},
        )
        response = connection.getresponse()
        body = response.read()
        length = int(response.getheader("Inference-Header-Content-Length", len(body)))
        return response.status, json.loads(body[:length]), body
    finally:
        connection.close()


def test_only_the_outputs_asked_for_are_sent(triton_server):
    rows = 8
    logits = np.random.default_rng(4).standard_normal((rows, VOCAB)).astype(np.float32)
    status, header, everything = raw_binary_infer(triton_server.http_url, logits, None)
    assert status == 200
    assert {o["name"] for o in header["outputs"]} == {
        "output_ids",
        "output_logprobs",
        "sampling_mask",
        "sampling_mask_len",
        "sampling_logprobs",
        "sampling_mask_logprobs",
        "sampling_seed",
    }
    status, header, ids_only = raw_binary_infer(triton_server.http_url, logits, ["output_ids"])
    assert status == 200 and [o["name"] for o in header["outputs"]] == ["output_ids"]
    status, header, masks = raw_binary_infer(
        triton_server.http_url, logits, ["output_ids", "sampling_mask", "sampling_mask_len"]
    )
    assert status == 200 and {o["name"] for o in header["outputs"]} == {
        "output_ids",
        "sampling_mask",
        "sampling_mask_len",
    }
    # Two [rows, W] float/int tensors dominate the full answer; naming ids alone sends 4 B a row.
    assert len(everything) >= rows * WIDTH * 4 * 2
    assert len(ids_only) < 1024
    assert rows * WIDTH * 4 <= len(masks) < rows * WIDTH * 4 + 2048


def test_generate_returns_per_support_logprobs_per_token(triton_server):
    generation = grpc_generate(
        triton_server.grpc_url,
        [5, 6, 7],
        6,
        top_k=12,
        temperature=0.9,
        seed=9,
        return_sampling_mask=True,
        ignore_eos=True,
    )
    support = generation.sampling_mask_logprobs
    assert support.shape == generation.sampling_mask.shape
    for step, length in enumerate(generation.sampling_mask_len):
        assert (support[step, length:] == np.float32(WIRE_NEG_INF)).all()  # JSON has no -inf
        assert abs(np.logaddexp.reduce(support[step, :length].astype(np.float64))) < 1e-5
        token = int(generation.output_ids[step])
        assert (
            support[step, list(generation.sampling_mask[step, :length]).index(token)]
            == generation.sampling_logprobs[step]
        )


def test_a_client_naming_no_mask_outputs_gets_none(http_client):
    logits = np.random.default_rng(5).standard_normal((2, VOCAB)).astype(np.float32)
    result = http_client.infer(
        "sampler", sampler_inputs(httpclient, logits, top_k=5), outputs=[httpclient.InferRequestedOutput("output_ids")]
    )
    assert result.as_numpy("output_ids").shape == (2, 1)
    assert result.as_numpy("sampling_mask") is None and result.as_numpy("sampling_mask_logprobs") is None
