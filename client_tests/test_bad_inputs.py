"""The bad-input matrix: every malformed request gets a 400 naming the offending field, over HTTP
and gRPC, whether Triton refuses it before the model (dtypes, shapes, batch sizes) or the model
does (values, mask admission); right after each, a valid request is answered correctly."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from testbed.server import infer
from triton_sampling_mask.client.wire import infer_input as tensor

from .reliability import INVALID_ARGUMENT, expect_error, valid_request_succeeds

ROWS, VOCAB = 2, 16
MAX_VOCAB_SIZE = 262144  # model_repository/sampler/config.pbtxt, parameter max_vocab_size
MAX_BATCH_SIZE = 256  # ... max_batch_size
MASK_WIDTH = 512  # ... dims of output sampling_mask


def logits_of(rows: int = ROWS, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(rows * 7919 + vocab).standard_normal((rows, vocab)).astype(np.float32)


def column(value, dtype, rows: int = ROWS) -> np.ndarray:
    return np.full((rows, 1), value, dtype)


@dataclass
class Case:
    """A malformed request: extra/replacement inputs as (name, array, datatype) triples."""

    id: str
    field: str  # must appear in the error message
    inputs: Callable[[], list[tuple[str, np.ndarray, str]]]
    model: str = "sampler"


def with_logits(*extra, logits=None) -> Callable:
    """Inputs: valid logits [ROWS, VOCAB] (unless given) plus `extra` (name, array, datatype)."""
    return lambda: [("logits", logits_of() if logits is None else logits, "FP32"), *extra]


def bytes_of(shape) -> np.ndarray:
    return np.full(shape, b"1.0", dtype=object)


def logits_with(value, everywhere: bool = False) -> np.ndarray:
    logits = logits_of()
    if everywhere:
        logits[1, :] = value
    else:
        logits[1, 3] = value
    return logits


def param_case(name: str, value, dtype=np.float32, datatype="FP32", **extra) -> Case:
    """A value that passes Triton's type checks but breaks a model rule for `name`."""
    extras = [(key, column(v, np.dtype(d)), dt) for key, (v, d, dt) in extra.items()]
    return Case(f"{name}={value}", name, with_logits((name, column(value, dtype), datatype), *extras))


MASK = ("return_sampling_mask", column(True, np.bool_), "BOOL")

CASES = [
    # Wrong datatypes, one or more per input (Triton refuses them before the model runs).
    Case("logits-fp64", "logits", lambda: [("logits", logits_of().astype(np.float64), "FP64")]),
    Case("logits-fp16", "logits", lambda: [("logits", logits_of().astype(np.float16), "FP16")]),
    Case("logits-int32", "logits", lambda: [("logits", logits_of().astype(np.int32), "INT32")]),
    Case("temperature-fp64", "temperature", with_logits(("temperature", column(1.0, np.float64), "FP64"))),
    Case("temperature-int32", "temperature", with_logits(("temperature", column(1, np.int32), "INT32"))),
    Case("top_k-int64", "top_k", with_logits(("top_k", column(5, np.int64), "INT64"))),
    Case("top_k-fp32", "top_k", with_logits(("top_k", column(5, np.float32), "FP32"))),
    Case("top_p-fp64", "top_p", with_logits(("top_p", column(0.9, np.float64), "FP64"))),
    Case("min_p-fp16", "min_p", with_logits(("min_p", column(0.1, np.float16), "FP16"))),
    Case("seed-int64", "seed", with_logits(("seed", column(1, np.int64), "INT64"))),
    Case("seed-fp32", "seed", with_logits(("seed", column(1, np.float32), "FP32"))),
    Case("mask-int32", "return_sampling_mask", with_logits(("return_sampling_mask", column(1, np.int32), "INT32"))),
    Case("mask-fp32", "return_sampling_mask", with_logits(("return_sampling_mask", column(1, np.float32), "FP32"))),
    # BYTES where numbers are expected.
    Case("logits-bytes", "logits", lambda: [("logits", bytes_of((ROWS, VOCAB)), "BYTES")]),
    Case("temperature-bytes", "temperature", with_logits(("temperature", bytes_of((ROWS, 1)), "BYTES"))),
    Case("top_k-bytes", "top_k", with_logits(("top_k", bytes_of((ROWS, 1)), "BYTES"))),
    Case("seed-bytes", "seed", with_logits(("seed", bytes_of((ROWS, 1)), "BYTES"))),
    Case("mask-bytes", "return_sampling_mask", with_logits(("return_sampling_mask", bytes_of((ROWS, 1)), "BYTES"))),
    # Wrong ranks and shapes.
    Case("logits-rank1", "logits", lambda: [("logits", logits_of()[0], "FP32")]),
    Case("logits-rank3", "logits", lambda: [("logits", logits_of()[None], "FP32")]),
    Case("temperature-width2", "temperature", with_logits(("temperature", np.ones((ROWS, 2), np.float32), "FP32"))),
    Case("top_k-rank1", "top_k", with_logits(("top_k", np.full(ROWS, 5, np.int32), "INT32"))),
    Case("seed-rank3", "seed", with_logits(("seed", np.ones((ROWS, 1, 1), np.uint64), "UINT64"))),
    # Batch size of a parameter differs from the logits' (Triton names whichever input it compared
    # first, which may be logits, so the check is on the batch-size wording).
    Case("temperature-batch3", "batch size", with_logits(("temperature", column(1.0, np.float32, rows=3), "FP32"))),
    Case("top_k-batch1", "batch size", with_logits(("top_k", column(5, np.int32, rows=1), "INT32"))),
    # Missing logits, empty or oversized vocabulary, oversized batch, unknown input.
    Case("missing-logits", "logits", lambda: [("temperature", column(1.0, np.float32), "FP32")]),
    Case("empty-vocab", "logits", lambda: [("logits", np.zeros((ROWS, 0), np.float32), "FP32")]),
    Case(
        "vocab-above-max", "max_vocab_size", lambda: [("logits", np.zeros((1, MAX_VOCAB_SIZE + 1), np.float32), "FP32")]
    ),
    Case("batch-above-max", "batch", lambda: [("logits", logits_of(rows=MAX_BATCH_SIZE + 1), "FP32")]),
    Case("unknown-input", "topk", with_logits(("topk", column(5, np.int32), "INT32"))),
    # NaN / infinities in the logits.
    Case("logits-nan", "logits", with_logits(logits=logits_with(np.nan))),
    Case("logits-+inf", "logits", with_logits(logits=logits_with(np.inf))),
    Case("logits-all--inf", "logits", with_logits(logits=logits_with(-np.inf, everywhere=True))),
    # NaN / infinities in each float parameter.
    *[param_case(name, value) for name in ("temperature", "top_p", "min_p") for value in (np.nan, np.inf, -np.inf)],
    # Out-of-range values of every parameter.
    param_case("temperature", -0.5),
    param_case("top_k", 0, np.int32, "INT32"),
    param_case("top_k", -2, np.int32, "INT32"),
    param_case("top_p", 0.0),
    param_case("top_p", 1.5),
    param_case("min_p", 1.0),
    param_case("min_p", -0.1),
    # Mask requests the deployment must refuse.
    Case("mask-unbounded", "top_k", with_logits(MASK)),
    Case("mask-top_p-only", "top_k", with_logits(MASK, ("top_p", column(0.9, np.float32), "FP32"))),
    Case(
        "mask-over-width",
        "top_k",
        with_logits(MASK, ("top_k", column(MASK_WIDTH + 1, np.int32), "INT32"), logits=logits_of(vocab=2 * MASK_WIDTH)),
    ),
    Case(
        "mask-speculative",
        "return_sampling_mask",
        with_logits(MASK, ("top_k", column(5, np.int32), "INT32")),
        "sampler_speculative",
    ),
    Case(
        "mask-no-support-backend",
        "return_sampling_mask",
        with_logits(MASK, ("top_k", column(5, np.int32), "INT32")),
        "sampler_nosupport",
    ),
    # One bad row fails its request, and the message says which row.
    Case("bad-second-row", "row 1", with_logits(("top_p", np.array([[0.9], [2.0]], np.float32), "FP32"))),
]


def test_matrix_is_large_and_distinct():
    ids = [case.id for case in CASES]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_a_400_naming_the_field(case, protocol):
    client, module = protocol
    inputs = [tensor(module, name, array, datatype) for name, array, datatype in case.inputs()]
    message = expect_error(lambda: client.infer(case.model, inputs), INVALID_ARGUMENT)
    assert case.field in message
    valid_request_succeeds(client, module, case.model, want_mask=case.model == "sampler")


def test_limits_at_their_edges_are_served(protocol):
    """The largest batch and the widest mask a request may ask for are answered in full: the
    worst-case response is max_batch_size rows of W mask ids."""
    client, module = protocol
    flat = np.zeros((MAX_BATCH_SIZE, 2 * MASK_WIDTH), np.float32)  # every token ties: the mask fills W
    outputs = infer(client, module, "sampler", flat, top_k=MASK_WIDTH, return_sampling_mask=True)
    assert outputs["sampling_mask"].shape == (MAX_BATCH_SIZE, MASK_WIDTH)
    assert (outputs["sampling_mask_len"] == MASK_WIDTH).all()
    # Ties are broken by lower id, so the support is ids 0..W-1 in order, for every row.
    assert (outputs["sampling_mask"] == np.arange(MASK_WIDTH, dtype=np.int32)).all()
    np.testing.assert_allclose(outputs["sampling_logprobs"], np.log(1 / MASK_WIDTH), rtol=1e-5)


def json_logits(shape, data, datatype="FP32") -> bytes:
    return json.dumps({"inputs": [{"name": "logits", "shape": shape, "datatype": datatype, "data": data}]}).encode()


BINARY_HEADER = json.dumps(
    {"inputs": [{"name": "logits", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}]}
).encode()
# Raw HTTP bodies tritonclient would never build: (id, body, extra headers, text the error names).
RAW_BODIES = [
    ("not-json", b"{nope", {}, "JSON"),
    ("no-inputs", b"{}", {}, "inputs"),
    ("data-count-mismatch", json_logits([1, 4], [1.0, 2.0]), {}, "data"),
    ("string-data", json_logits([1, 2], ["a", "b"]), {}, "data"),
    ("negative-dim", json_logits([1, -2], [1.0, 2.0]), {}, "shape"),
    (
        "binary-size-lie",
        BINARY_HEADER + b"\0" * 8,
        {"Inference-Header-Content-Length": str(len(BINARY_HEADER)), "Content-Type": "application/octet-stream"},
        "logits",
    ),
]


@pytest.mark.parametrize("body, headers, names", [r[1:] for r in RAW_BODIES], ids=[r[0] for r in RAW_BODIES])
def test_malformed_http_body_is_refused_and_the_server_serves_on(body, headers, names, triton_server, http_client):
    """Triton's HTTP frontend refuses these before the model. Triton 2.51 answers JSON it cannot
    parse with 500, not 400 (the same INTERNAL-for-parse-error mapping as upstream
    triton-inference-server/server#8762 / open PR #8773), which no model can change; what must
    hold is a clean error naming the part, a live server, then normal service."""
    request = urllib.request.Request(
        f"http://{triton_server.http_url}/v2/models/sampler/infer",
        data=body,
        headers={"Content-Type": "application/json", **headers},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code in (400, 500)
    assert names in json.loads(caught.value.read())["error"]
    assert triton_server.process.poll() is None
    valid_request_succeeds(http_client, httpclient)


def grpc_request(raw_contents: list[bytes], datatype: str = "FP32"):
    """A ModelInferRequest for `sampler` with logits [1, 4] built by hand, as tritonclient never would."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="sampler")
    request.inputs.add(name="logits", datatype=datatype).shape.extend([1, 4])
    request.raw_input_contents.extend(raw_contents)
    return request


RAW_GRPC = [
    ("raw-size-lie", lambda: grpc_request([b"\0" * 8]), "logits"),
    ("raw-contents-missing", lambda: grpc_request([]), "logits"),
    ("unknown-datatype", lambda: grpc_request([b"\0" * 16], datatype="FP99"), "logits"),
]


@pytest.mark.parametrize("build, names", [r[1:] for r in RAW_GRPC], ids=[r[0] for r in RAW_GRPC])
def test_malformed_grpc_message_is_invalid_argument(build, names, triton_server, grpc_client):
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(triton_server.grpc_url) as channel, pytest.raises(grpc.RpcError) as caught:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(build(), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert names in caught.value.details()
    valid_request_succeeds(grpc_client, grpcclient)
