"""Every admission and input check through a real server: status code, message, neighbours unharmed."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from testbed.server import MODEL_REPOSITORY, OUTPUTS, TritonServer, infer, sampler_inputs, set_parameter
from triton_sampling_mask.sampling.validation import (
    SPECULATIVE_MASK_MESSAGE,
    UNBOUNDED_MASK_MESSAGE,
    SamplingRequestError,
)

LOGITS = np.random.default_rng(0).standard_normal((1, 1000)).astype(np.float32)


def expect_invalid(protocol, model, logits, fragment, **params):
    """Assert the request fails with 400 / INVALID_ARGUMENT and a message containing `fragment`."""
    client, module = protocol
    with pytest.raises(InferenceServerException) as caught:
        infer(client, module, model, logits, **params)
    status = caught.value.status()
    assert status in ("400", "StatusCode.INVALID_ARGUMENT"), (status, caught.value.message())
    assert fragment in caught.value.message(), caught.value.message()
    return caught.value.message()


@pytest.mark.parametrize("top_p", [0.9, 1.0], ids=["top_p_only", "full_vocabulary"])
def test_unbounded_mask_is_rejected_with_the_35205_message(protocol, top_p):
    expect_invalid(protocol, "sampler", LOGITS, UNBOUNDED_MASK_MESSAGE, top_p=top_p, return_sampling_mask=True)


def test_mask_wider_than_w_is_rejected_naming_top_k_w_and_config(protocol):
    message = expect_invalid(protocol, "sampler", LOGITS, "top_k=513", top_k=513, return_sampling_mask=True)
    assert "W=512" in message and "sampling_mask" in message
    # The file is named relative to the model repository: clients never see the server's paths.
    assert "'sampling_mask' in sampler/config.pbtxt" in message and "/model_repository" not in message


def test_mask_at_the_width_is_accepted(protocol):
    client, module = protocol
    out = infer(client, module, "sampler", LOGITS, top_k=512, return_sampling_mask=True)
    assert out["sampling_mask_len"][0, 0] == 512


def test_speculative_decoding_refuses_masks_only(protocol):
    expect_invalid(
        protocol, "sampler_speculative", LOGITS, SPECULATIVE_MASK_MESSAGE, top_k=5, return_sampling_mask=True
    )
    client, module = protocol
    out = infer(client, module, "sampler_speculative", LOGITS, top_k=5)
    assert 0 <= out["output_ids"][0, 0] < 1000


def test_backend_without_support_refuses_masks_only(protocol):
    expect_invalid(
        protocol,
        "sampler_nosupport",
        LOGITS,
        "return_sampling_mask is not supported with the nosupport sampling backend.",
        top_k=5,
        return_sampling_mask=True,
    )
    client, module = protocol
    out = infer(client, module, "sampler_nosupport", LOGITS, top_k=5)
    assert 0 <= out["output_ids"][0, 0] < 1000


BAD_PARAMETERS = [
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=np.nan), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.0), "min_p"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=np.inf), "temperature"),
    (dict(temperature=np.nan), "temperature"),
]


@pytest.mark.parametrize("params, field", BAD_PARAMETERS, ids=[f"{f}={list(p.values())[0]}" for p, f in BAD_PARAMETERS])
def test_bad_parameters_name_the_field(protocol, params, field):
    expect_invalid(protocol, "sampler", LOGITS, field, **params)


@pytest.mark.parametrize(
    "value, fragment",
    [(np.nan, "NaN"), (np.inf, "+inf")],
)
def test_bad_logits_name_the_field(protocol, value, fragment):
    logits = LOGITS.copy()
    logits[0, 10] = value
    message = expect_invalid(protocol, "sampler", logits, fragment, top_k=5)
    assert "logits" in message


def test_all_negative_infinite_logits(protocol):
    expect_invalid(protocol, "sampler", np.full((1, 10), -np.inf), "logits must have at least one finite value")


def test_empty_vocabulary(protocol):
    expect_invalid(protocol, "sampler", np.zeros((1, 0)), "logits")


def test_parameter_batch_size_mismatch(protocol):
    client, module = protocol
    inputs = sampler_inputs(module, np.zeros((2, 10)))
    top_k = module.InferInput("top_k", [3, 1], "INT32")
    top_k.set_data_from_numpy(np.full((3, 1), 4, np.int32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("sampler", [*inputs, top_k])
    assert caught.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert "batch size" in caught.value.message()


def test_a_top_k_past_int32_is_refused_naming_the_value_or_the_wrap(triton_server):
    """The client's wire builder refuses it with its true value; sent as HTTP JSON anyway, Triton
    wraps 2**31 to -2**31 before the model sees it (docs/upstream-issues.md), and the 400 says so."""
    import tritonclient.http as httpclient

    with pytest.raises(SamplingRequestError, match="top_k must be an integer in .*, got 2147483648$"):
        sampler_inputs(httpclient, LOGITS, top_k=2**31)
    body = json.dumps(
        {
            "inputs": [
                {"name": "logits", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]},
                {"name": "top_k", "shape": [1, 1], "datatype": "INT32", "data": [2**31]},
            ]
        }
    ).encode()

    def refusal(http_url: str) -> tuple[int, str]:
        request = urllib.request.Request(
            f"http://{http_url}/v2/models/sampler/infer", data=body, headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        return caught.value.code, json.loads(caught.value.read())["error"]

    # The front door reads the JSON itself: the value is no INT32, refused as sent.
    status, message = refusal(triton_server.http_url)
    assert status == 400 and "top_k" in message, message
    # tritonserver's own port (behind the local door, or bare): wrapped before the model sees it.
    own = getattr(triton_server, "server", None) or (triton_server if isinstance(triton_server, TritonServer) else None)
    if own is not None:  # an external server's own port is not reachable from here
        status, message = refusal(own.http_url)
        assert status == 400 and message.startswith("top_k must be -1 (whole vocabulary) or >= 1"), message
        assert "over HTTP JSON, a value of 2**31 or more arrives wrapped" in message


def test_a_bad_row_fails_only_its_own_request_and_names_the_row(protocol):
    logits = np.zeros((3, 10))
    message = expect_invalid(protocol, "sampler", logits, "(row 1)", top_k=[3, 0, 3])
    assert "top_k" in message


def test_concurrent_burst_of_mixed_requests(http_client, grpc_client):
    """Valid and invalid requests interleaved from many threads: every valid one is answered."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    rng = np.random.default_rng(11)
    cases = []
    for i in range(96):
        logits = rng.standard_normal((1 + i % 3, 2000)).astype(np.float32)
        if i % 4 == 0:
            cases.append((logits, dict(top_p=0.9, return_sampling_mask=True), False))
        elif i % 4 == 1:
            cases.append((logits, dict(top_k=0), False))
        else:
            cases.append((logits, dict(top_k=40, seed=i, return_sampling_mask=bool(i % 2)), True))

    def outcome(call):
        try:
            result = call()
        except InferenceServerException as exc:
            return exc.status(), exc.message()
        return "ok", {name: result.as_numpy(name) for name in OUTPUTS}

    # HTTP requests go out asynchronously (tritonclient.http is gevent-based, not thread-safe)
    # while gRPC requests are sent from threads, so both protocols overlap in the server's batches.
    pending = {
        i: http_client.async_infer("sampler", sampler_inputs(httpclient, cases[i][0], **cases[i][1]))
        for i in range(0, len(cases), 2)
    }

    def grpc_call(i):
        return outcome(lambda: grpc_client.infer("sampler", sampler_inputs(grpcclient, cases[i][0], **cases[i][1])))

    with ThreadPoolExecutor(max_workers=16) as pool:
        grpc_results = dict(zip(range(1, len(cases), 2), pool.map(grpc_call, range(1, len(cases), 2))))
    results = [grpc_results[i] if i % 2 else outcome(pending[i].get_result) for i in range(len(cases))]
    # Triton's queue sheds nothing (shedding is the front proxy's): every request gets its answer.
    for (logits, params, valid), (status, out) in zip(cases, results):
        if valid:
            assert status == "ok", (status, out)
            assert out["output_ids"].shape == (logits.shape[0], 1)
            if params["return_sampling_mask"]:
                assert (out["sampling_mask_len"] == 40).all()
        else:
            assert status in ("400", "StatusCode.INVALID_ARGUMENT"), (status, out)
    assert sum(status == "ok" for status, _ in results) == sum(valid for _, _, valid in cases)


def test_unknown_backend_fails_model_load_listing_the_choices(tmp_path):
    repository = tmp_path / "repo"
    (repository / "sampler" / "1").mkdir(parents=True)
    (repository / "sampler" / "1" / "model.py").write_text(
        (MODEL_REPOSITORY / "sampler" / "1" / "model.py").read_text()
    )
    config = set_parameter(
        (MODEL_REPOSITORY / "sampler" / "config.pbtxt").read_text(), "sampling_backend", "warp-drive"
    )
    (repository / "sampler" / "config.pbtxt").write_text(config)
    server = TritonServer(repository, extra_args=["--model-control-mode=explicit"], log_path=tmp_path / "log")
    with server:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(server.http_url)
        try:
            with pytest.raises(InferenceServerException) as caught:
                client.load_model("sampler")
            message = caught.value.message()
            assert "unknown sampling_backend 'warp-drive'" in message and "choose one of: torch" in message
            assert client.is_server_live()
        finally:
            client.close()  # an open connection would hold the server's shutdown for its 30 s timeout
