"""The `generate` model against a real tritonserver: alignment, stops, streaming, checks, cancellation.

Every mask row is checked against a float64 replay of the default LM (full forward, no cache)
fed to the float64 numpy reference of the sampling rules.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from testbed.metrics import counter
from tests.lm_reference import greedy_continuations, step_logits
from tests.reference import reference_row
from triton_sampling_mask.sampling.validation import UNBOUNDED_MASK_MESSAGE

from .generate_client import GenerateStream, collect, grpc_generate, http_generate

PROMPT = [5, 6, 7]
SAMPLED = dict(temperature=0.7, top_k=10, top_p=0.9, min_p=0.03, seed=11, return_sampling_mask=True)
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")


@pytest.fixture(scope="module")
def width(http_client) -> int:
    """W, read from the served model's config (its only source)."""
    config = http_client.get_model_config("generate")
    return int(next(o for o in config["output"] if o["name"] == "sampling_mask")["dims"][-1])


@pytest.fixture(scope="module")
def vocab_size() -> int:
    from tests.lm_reference import replica

    return replica().config.vocab_size


def run(protocol: str, server, prompt, max_new_tokens: int, width: int, **params):
    """A non-streamed generation over gRPC (stream API, one response) or HTTP /generate."""
    if protocol == "grpc":
        return grpc_generate(server.grpc_url, prompt, max_new_tokens, **params)
    status, result = http_generate(server.http_url, prompt, max_new_tokens, width, **params)
    assert status == 200, result
    return result


def assert_aligned(result, n: int, width: int) -> None:
    """One mask row, length and logprob per output token."""
    assert result.output_ids.shape == (n,)
    for name in ("output_logprobs", "sampling_mask_len", "sampling_logprobs"):
        assert getattr(result, name).shape == (n,), name
    assert result.sampling_mask.shape == (n, width)
    for i in range(n):  # ids first, then -1 padding
        assert (result.sampling_mask[i, result.sampling_mask_len[i] :] == -1).all()


def assert_rows_match_reference(result, prompt, **params) -> None:
    """Each returned row equals the support the float64 reference computes from the LM's logits."""
    logits = step_logits(prompt, result.output_ids)
    rules = {k: params[k] for k in SAMPLING_KEYS if k in params}
    for i, token in enumerate(result.output_ids):
        ref = reference_row(logits[i], tolerance=1e-5, **rules)
        row = result.mask_row(i)
        assert ref.support_min <= len(row) <= ref.support_max, f"step {i}"
        np.testing.assert_array_equal(row, ref.order[: len(row)], err_msg=f"step {i}")
        assert token in row, f"step {i}: token {token} outside its mask"
        assert result.output_logprobs[i] == pytest.approx(ref.logprobs[token], abs=1e-3)
        assert result.sampling_logprobs[i] == pytest.approx(ref.renormalised_logprob(token, len(row)), abs=1e-3)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_sampled_rows_align_and_match_reference(protocol, triton_server, width):
    result = run(protocol, triton_server, PROMPT, 12, width, ignore_eos=True, **SAMPLED)
    assert_aligned(result, 12, width)
    assert result.finish_reason == "length"
    assert (result.sampling_mask_len > 1).any(), "the test should exercise non-trivial supports"
    assert_rows_match_reference(result, PROMPT, **SAMPLED)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_greedy_rows_are_the_argmax(protocol, triton_server, width):
    prompt = [11, 12, 13, 14]
    result = run(protocol, triton_server, prompt, 8, width, temperature=0.0, return_sampling_mask=True, ignore_eos=True)
    assert_aligned(result, 8, width)
    expected, _ = greedy_continuations(np.array([prompt]), 8)
    np.testing.assert_array_equal(result.output_ids, expected[0])
    np.testing.assert_array_equal(result.sampling_mask_len, np.ones(8))
    np.testing.assert_array_equal(result.sampling_mask[:, 0], expected[0])
    assert_rows_match_reference(result, prompt, temperature=0.0)


def test_streaming_equals_non_streaming(triton_server, width):
    whole = grpc_generate(triton_server.grpc_url, PROMPT, 10, ignore_eos=True, **SAMPLED)
    streamed = grpc_generate(triton_server.grpc_url, PROMPT, 10, ignore_eos=True, stream=True, **SAMPLED)
    # a response per token, but for tokens that came while the previous response was being sent
    assert sum(len(r["output_ids"]) for r in streamed.responses) == 10
    assert all(r["sampling_mask"].shape == (len(r["output_ids"]), width) >= (1, width) for r in streamed.responses)
    finish = [r["finish_reason"][0] for r in streamed.responses]
    assert finish == [b""] * (len(finish) - 1) + [b"length"]
    for name in ("output_ids", "output_logprobs", "sampling_mask", "sampling_mask_len", "sampling_logprobs"):
        np.testing.assert_array_equal(getattr(streamed, name), getattr(whole, name), err_msg=name)
    assert streamed.finish_reason == whole.finish_reason == "length"


def _sent_outputs(stream: GenerateStream) -> list[dict]:
    """Every response of the stream's one request, to its final: {output name: array as sent}."""
    responses = []
    while True:
        result, error = stream.responses.get(timeout=120)
        assert error is None, error
        response = result.get_response()
        responses.append({o.name: result.as_numpy(o.name) for o in response.outputs})
        if response.parameters["triton_final_response"].bool_param:
            return [r for r in responses if r]  # the empty final response, if any, left out


def test_a_response_carries_the_outputs_asked_for_and_the_shared_ones_once(triton_server):
    with GenerateStream(triton_server.grpc_url) as stream:
        stream.send(PROMPT, 4, ignore_eos=True, stream=True, seed=21)
        streamed = _sent_outputs(stream)
        stream.send(PROMPT, 4, ignore_eos=True, seed=21)
        [whole] = _sent_outputs(stream)
        stream.send(PROMPT, 4, ignore_eos=True, stream=True, seed=21, outputs=["output_ids"])
        ids_only = _sent_outputs(stream)
    # Streamed (a response per token, or one for the tokens that came while the previous was sent):
    # the seed and the weight version on the first response only (no update landed).
    carried = [("sampling_seed" in r, "weight_version" in r) for r in streamed]
    assert carried == [(True, True)] + [(False, False)] * (len(streamed) - 1)
    assert streamed[0]["sampling_seed"].tolist() == [[21]]
    assert streamed[0]["weight_version"].tolist() == [[b"default"]]
    assert all(r["output_ids"].shape[0] == 1 <= r["output_ids"].shape[1] for r in streamed)
    assert sum(r["output_ids"].shape[1] for r in streamed) == 4
    # Whole: one value standing for its 4 tokens.
    assert whole["output_ids"].shape == (1, 4)
    assert whole["sampling_seed"].tolist() == [[21]] and whole["weight_version"].tolist() == [[b"default"]]
    # Naming output_ids alone gets output_ids alone, on every response.
    assert [sorted(r) for r in ids_only] == [["output_ids"]] * len(ids_only)
    np.testing.assert_array_equal(
        np.concatenate([r["output_ids"][0] for r in ids_only]), np.concatenate([r["output_ids"][0] for r in streamed])
    )


def test_seeded_generation_reproduces_and_masks_do_not_change_tokens(triton_server):
    with_mask = grpc_generate(triton_server.grpc_url, PROMPT, 10, ignore_eos=True, **SAMPLED)
    again = grpc_generate(triton_server.grpc_url, PROMPT, 10, ignore_eos=True, **SAMPLED)
    without = grpc_generate(
        triton_server.grpc_url, PROMPT, 10, ignore_eos=True, **{**SAMPLED, "return_sampling_mask": False}
    )
    np.testing.assert_array_equal(again.output_ids, with_mask.output_ids)
    np.testing.assert_array_equal(again.sampling_mask, with_mask.sampling_mask)
    np.testing.assert_array_equal(without.output_ids, with_mask.output_ids)
    np.testing.assert_array_equal(without.output_logprobs, with_mask.output_logprobs)
    assert (without.sampling_mask_len == 0).all() and (without.sampling_mask == -1).all()
    other_seed = grpc_generate(triton_server.grpc_url, PROMPT, 10, ignore_eos=True, **{**SAMPLED, "seed": 12})
    assert not np.array_equal(other_seed.output_ids, with_mask.output_ids)


@pytest.mark.parametrize("mode", ["grpc", "grpc-stream", "http"])
def test_max_new_tokens_zero_returns_empty_outputs(mode, triton_server, width):
    if mode == "http":
        result = run("http", triton_server, PROMPT, 0, width, **SAMPLED)
    else:
        result = grpc_generate(triton_server.grpc_url, PROMPT, 0, stream=mode == "grpc-stream", **SAMPLED)
        assert len(result.responses) == 1
    assert_aligned(result, 0, width)
    assert result.finish_reason == "length"


def _prompt_reaching_eos(eos: int) -> tuple[list[int], int]:
    """A prompt whose greedy continuation meets EOS (first at index j), argmax safely decided."""
    prompts = np.random.default_rng(0).integers(3, 1024, size=(4096, 3))
    tokens, gaps = greedy_continuations(prompts, 4)
    hits = [(int(np.argmax(row == eos)), b) for b, row in enumerate(tokens) if (row == eos).any() and gaps[b] > 1e-3]
    assert hits, "no greedy continuation of the candidate prompts meets EOS"
    j, b = max(hits)  # the latest EOS: tokens before it show that earlier rows are kept too
    return prompts[b].tolist(), j


def test_eos_ends_generation_and_keeps_its_row(triton_server, width):
    eos = 2  # eos_token_id of plugin/generation/lm_configs/tiny_llama.json
    prompt, j = _prompt_reaching_eos(eos)
    stopped = grpc_generate(triton_server.grpc_url, prompt, 8, temperature=0.0, return_sampling_mask=True)
    assert_aligned(stopped, j + 1, width)
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids[-1] == eos and stopped.mask_row(j).tolist() == [eos]
    ignored = grpc_generate(
        triton_server.grpc_url, prompt, 8, temperature=0.0, return_sampling_mask=True, ignore_eos=True
    )
    assert ignored.finish_reason == "length" and len(ignored.output_ids) == 8
    np.testing.assert_array_equal(ignored.output_ids[: j + 1], stopped.output_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ends_generation_and_keeps_its_row(stream, triton_server, width):
    free = grpc_generate(triton_server.grpc_url, PROMPT, 8, ignore_eos=True, **SAMPLED)
    ids = free.output_ids.tolist()
    j = next(i for i in range(1, 8) if ids[i] not in ids[:i])
    unused = next(t for t in range(3, 1024) if t not in ids)
    stopped = grpc_generate(
        triton_server.grpc_url, PROMPT, 8, ignore_eos=True, stream=stream, stop_token_ids=[unused, ids[j]], **SAMPLED
    )
    assert_aligned(stopped, j + 1, width)
    assert stopped.finish_reason == "stop"
    np.testing.assert_array_equal(stopped.output_ids, free.output_ids[: j + 1])
    np.testing.assert_array_equal(stopped.sampling_mask, free.sampling_mask[: j + 1])


def test_concurrent_requests_match_solo_runs(triton_server):
    requests = {
        "a": ([5, 6, 7], dict(SAMPLED, seed=1)),
        "b": ([40, 41, 42, 43, 44, 45, 46], dict(SAMPLED, seed=2, top_k=5)),
        "c": ([9], dict(temperature=0.0, return_sampling_mask=True)),
    }
    responses: dict[str, list] = {name: [] for name in requests}
    with GenerateStream(triton_server.grpc_url) as stream:
        for name, (prompt, params) in requests.items():  # sent back to back: batched together
            stream.send(prompt, 6, request_id=name, ignore_eos=True, **params)
        finished = 0
        while finished < len(requests):
            request_id, outputs, final, error = stream.next()
            assert error is None, error
            responses[request_id].append(outputs)
            finished += final
    for name, (prompt, params) in requests.items():
        together = collect(responses[name])
        alone = grpc_generate(triton_server.grpc_url, prompt, 6, ignore_eos=True, **params)
        np.testing.assert_array_equal(together.output_ids, alone.output_ids, err_msg=name)
        assert_rows_match_reference(together, prompt, **params)


REJECTIONS = [
    ({"temperature": 1.0, "return_sampling_mask": True}, UNBOUNDED_MASK_MESSAGE),
    ({"temperature": 1.0, "top_p": 0.9, "return_sampling_mask": True}, UNBOUNDED_MASK_MESSAGE),
    ({"top_k": 10_000, "return_sampling_mask": True}, "top_k"),
    ({"top_p": 1.5}, "top_p"),
    ({"input_ids": [5, 1024]}, "input_ids"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"max_new_tokens": 600}, "max_new_tokens"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"input_ids": []}, "input_ids"),
]


@pytest.mark.parametrize("overrides, expected", REJECTIONS)
def test_invalid_requests_are_rejected_before_generation(overrides, expected, triton_server, width):
    args = {"input_ids": PROMPT, "max_new_tokens": 8, **overrides}
    prompt, budget = args.pop("input_ids"), args.pop("max_new_tokens")
    tokens_before = counter(triton_server.metrics_url, "generate_tokens_total")
    with pytest.raises(InferenceServerException) as error:
        grpc_generate(triton_server.grpc_url, prompt, budget, stream=True, **args)
    assert expected in error.value.message()
    if expected == UNBOUNDED_MASK_MESSAGE:
        assert error.value.message() == UNBOUNDED_MASK_MESSAGE
    status, body = http_generate(triton_server.http_url, prompt, budget, width, **args)
    assert status == 400 and expected in body["error"]
    assert counter(triton_server.metrics_url, "generate_tokens_total") == tokens_before, "a token was generated"


def test_cancellation_stops_generation(triton_server):
    budget = 500  # near the context limit: far more than the few tokens before the cancel
    tokens_before = counter(triton_server.metrics_url, "generate_tokens_total")
    cancelled_before = counter(triton_server.metrics_url, "generate_cancelled_total")
    stream = GenerateStream(triton_server.grpc_url)
    stream.send([5, 6, 7], budget, stream=True, ignore_eos=True, **SAMPLED)
    for _ in range(3):
        _, outputs, final, error = stream.next()
        assert error is None and not final
    stream.close(cancel=True)
    deadline = time.monotonic() + 60  # a wait for the server's counter, not a timing assertion
    while counter(triton_server.metrics_url, "generate_cancelled_total") == cancelled_before:
        assert time.monotonic() < deadline, "the server never saw the cancellation"
        time.sleep(0.05)
    generated = counter(triton_server.metrics_url, "generate_tokens_total") - tokens_before
    assert 3 <= generated < budget
    assert "request cancelled by the client" in triton_server.log_tail(20_000)
    # The instance is free again: a new request is answered.
    assert len(grpc_generate(triton_server.grpc_url, PROMPT, 2, ignore_eos=True).output_ids) == 2


def test_a_request_with_two_prompts_is_rejected(triton_server):
    import tritonclient.grpc as grpcclient

    with GenerateStream(triton_server.grpc_url) as stream:
        inputs = []
        for name, array, datatype in (
            ("input_ids", np.array([[5, 6], [7, 8]], np.int32), "INT32"),
            ("max_new_tokens", np.array([[4], [4]], np.int32), "INT32"),
        ):
            inputs.append(grpcclient.InferInput(name, list(array.shape), datatype))
            inputs[-1].set_data_from_numpy(array)
        stream.client.async_stream_infer("generate", inputs, enable_empty_final_response=True)
        _, _, final, error = stream.next()
    assert final and error is not None and "batch size 1" in error.message() and "input_ids" in error.message()


def test_http_generate_stream_sends_the_tokens_as_events(triton_server):
    import json
    import urllib.request

    body = {"input_ids": PROMPT, "max_new_tokens": 5, "stream": True, "ignore_eos": True, **SAMPLED}
    request = urllib.request.Request(
        f"http://{triton_server.http_url}/v2/models/generate/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [json.loads(line[5:]) for line in response.read().decode().splitlines() if line.startswith("data:")]
    whole = grpc_generate(triton_server.grpc_url, PROMPT, 5, ignore_eos=True, **SAMPLED)
    # An event holds one token (JSON renders a one-element tensor as a scalar) or, when tokens came
    # while the previous event was being sent, a list of them.
    assert np.concatenate([np.atleast_1d(e["output_ids"]) for e in events]).tolist() == whole.output_ids.tolist()
    assert [e["finish_reason"] for e in events][-1] == "length"
