"""Client helpers for the `generate` model: gRPC streams, HTTP /generate, the server's counters."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient

from triton_sampling_mask.client.wire import GENERATE_DTYPES, NUMPY_DTYPES
from triton_sampling_mask.sampling.outputs import FINISH_REASON, MASK, TIMING_OUTPUTS, TOKEN_OUTPUT_NAMES, TOKEN_OUTPUTS


@dataclass
class Generation:
    """A request's outputs, concatenated over its responses (n tokens, W mask columns)."""

    output_ids: np.ndarray
    output_logprobs: np.ndarray
    sampling_mask: np.ndarray
    sampling_mask_len: np.ndarray
    sampling_logprobs: np.ndarray
    sampling_mask_logprobs: np.ndarray
    finish_reason: str
    responses: list  # per response: dict of numpy outputs (batch dimension dropped)

    def mask_row(self, i: int) -> np.ndarray:
        return self.sampling_mask[i, : self.sampling_mask_len[i]]


def generate_inputs(prompt, max_new_tokens: int, **params) -> list:
    """gRPC InferInputs for one request: every tensor gets the leading batch dimension 1."""
    values = {"input_ids": np.asarray(prompt), "max_new_tokens": max_new_tokens, **params}
    inputs = []
    for name, value in values.items():
        datatype = GENERATE_DTYPES[name]
        array = np.asarray(value, dtype=NUMPY_DTYPES[datatype]).reshape(1, -1)
        infer_input = grpcclient.InferInput(name, list(array.shape), datatype)
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


class GenerateStream:
    """One gRPC stream to the server (a context manager); requests go out, responses queue up."""

    def __init__(self, url: str, model: str = "generate"):
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def send(self, prompt, max_new_tokens: int, request_id: str = "", outputs=None, **params) -> None:
        """Send one request; `outputs`: the output names to ask for (None: every one)."""
        self.client.async_stream_infer(
            self.model,
            generate_inputs(prompt, max_new_tokens, **params),
            request_id=request_id,
            outputs=None if outputs is None else [grpcclient.InferRequestedOutput(name) for name in outputs],
            enable_empty_final_response=True,
        )

    def next(self, timeout_s: float = 120.0):
        """(request id, outputs dict or None, final flag, error or None) of the next response."""
        result, error = self.responses.get(timeout=timeout_s)
        if error is not None:
            return None, None, True, error
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        outputs = {name: result.as_numpy(name) for name in (*TOKEN_OUTPUT_NAMES, FINISH_REASON.name)}
        outputs = None if outputs["output_ids"] is None else {k: v[0] for k, v in outputs.items()}
        for spec in TIMING_OUTPUTS:  # a request's last response only
            value = result.as_numpy(spec.name)
            if outputs is not None and value is not None:
                outputs[spec.name] = float(value.reshape(-1)[0])
        return response.id, outputs, final, None

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def collect(responses: list[dict]) -> Generation:
    """Concatenate the responses of one request in arrival order."""
    parts = {name: np.concatenate([r[name] for r in responses]) for name in TOKEN_OUTPUT_NAMES}
    finish = responses[-1]["finish_reason"][0]
    return Generation(
        **parts, finish_reason=finish.decode() if isinstance(finish, bytes) else str(finish), responses=responses
    )


def _not_json(constant: str):
    raise ValueError(f"the answer is not strict JSON: it carries {constant}")


def grpc_generate(url: str, prompt, max_new_tokens: int, model: str = "generate", **params) -> Generation:
    """One request over a gRPC stream, read to its final response; raises its error, if any."""
    with GenerateStream(url, model) as stream:
        stream.send(prompt, max_new_tokens, **params)
        responses = []
        while True:
            _, outputs, final, error = stream.next()
            if error is not None:
                raise error
            if outputs is not None:
                responses.append(outputs)
            if final:
                return collect(responses)


def http_generate(
    url: str, prompt, max_new_tokens: int, width: int, model: str = "generate", **params
) -> tuple[int, dict | Generation]:
    """POST /v2/models/<model>/generate: (200, Generation) or (status, error JSON)."""
    body = {"input_ids": [int(t) for t in prompt], "max_new_tokens": max_new_tokens}
    body.update({k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in params.items()})
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read(), parse_constant=_not_json)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    # JSON carries tensors flat (mask rows as n*W values), the -inf padding as float32's lowest
    # value: a strict parser reads every answer.
    arrays = {
        spec.name: np.array(reply[spec.name], spec.dtype).reshape((-1, width) if spec.per == MASK else -1)
        for spec in TOKEN_OUTPUTS
    }
    return 200, Generation(**arrays, finish_reason=reply["finish_reason"], responses=[reply])


def assert_matches_reference(result, logits: np.ndarray, **rules) -> None:
    """Each token of `result` (a GenerateResult or Generation) against the float64 reference of
    the logits it was sampled from (`logits` [n, V]; `rules`: temperature, top_k, top_p, min_p):
    its mask row in the reference's order, the token inside it, its two log-probs."""
    import pytest

    from tests.reference import reference_row

    for i, token in enumerate(result.output_ids):
        ref = reference_row(logits[i], tolerance=1e-5, **rules)
        row = result.sampling_mask[i, : result.sampling_mask_len[i]]
        assert ref.support_min <= len(row) <= ref.support_max, f"step {i}"
        np.testing.assert_array_equal(row, ref.order[: len(row)], err_msg=f"step {i}")
        assert token in row, f"step {i}: token {token} outside its mask"
        assert result.output_logprobs[i] == pytest.approx(ref.logprobs[token], abs=1e-3)
        assert result.sampling_logprobs[i] == pytest.approx(ref.renormalised_logprob(token, len(row)), abs=1e-3)
