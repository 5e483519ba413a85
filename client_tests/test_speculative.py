"""Speculative decoding through a real tritonserver of its own: "ngram" returns exactly what plain
decoding returns, and masks stay refused wherever that is not proven.

The server holds the shipped `generate` model twice with the LM in float64 (so a one-token and a
multi-token forward pass round alike): `generate_plain` (speculative_algorithm "none") and
`generate_ngram`; `generate_eagle`, an algorithm the engine does not draft; and `sampler_ngram`,
the sampler model told "ngram" (it cannot verify anything, so it keeps refusing masks).
"""

from __future__ import annotations

import re
import runpy

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from testbed.metrics import counter, wait_for_counter
from testbed.server import REPO_ROOT, ExternalTritonServer, TritonServer, copy_model, infer
from triton_sampling_mask.sampling.validation import SPECULATIVE_MASK_MESSAGE

from .generate_client import GenerateStream, collect, http_generate
from .test_generate_engine import build_engine_repository, read_to_final

PLAIN, NGRAM, EAGLE, SAMPLER_NGRAM = "generate_plain", "generate_ngram", "generate_eagle", "sampler_ngram"
VARIANTS = {
    PLAIN: {"lm_dtype": "float64"},
    NGRAM: {"lm_dtype": "float64", "speculative_algorithm": "ngram"},
    EAGLE: {"speculative_algorithm": "eagle"},
}
REPETITIVE = [[5, 6, 7, 8] * 6, [100, 200] * 8, [9] * 6, [40, 41, 42, 43, 44, 40, 41, 42]]
OTHER = [[11, 12, 13], [700], [300, 17, 512, 77, 5]]
PARAMETERS = [
    dict(temperature=0.0, return_sampling_mask=True),
    dict(temperature=0.7, top_k=10, top_p=0.9, min_p=0.03, return_sampling_mask=True),
    dict(temperature=0.3, top_k=20, return_sampling_mask=True),
    dict(temperature=1.0, top_p=0.8),  # unbounded: no mask
    dict(temperature=1.0, top_k=50, min_p=0.1, return_sampling_mask=True),
]
EXACT = ("output_ids", "sampling_mask", "sampling_mask_len")
CLOSE = ("output_logprobs", "sampling_logprobs", "sampling_mask_logprobs")


@pytest.fixture(scope="module")
def speculative_server(tmp_path_factory):
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("starts a local CPU tritonserver with generate variants of its own")
    repository = build_engine_repository(tmp_path_factory.mktemp("speculative_models"), VARIANTS)
    copy_model(repository, "sampler", SAMPLER_NGRAM, {"speculative_algorithm": "ngram"})
    with TritonServer(repository, log_path=tmp_path_factory.mktemp("speculative_logs") / "tritonserver.log") as server:
        yield server


def requests(server) -> dict[str, tuple[list[int], int, dict]]:
    """Every prompt under every parameter set, each with its own seed and a third of them
    streamed, ending at max_new_tokens (EOS ignored), at EOS or max_new_tokens, or at a stop id:
    a token plain decoding generates midway, so generation stops there (inside an accepted draft
    when the output repeats). Request id -> (prompt, max_new_tokens, inputs)."""
    out, stopped = {}, {}
    for p, prompt in enumerate(REPETITIVE + OTHER):
        for q, params in enumerate(PARAMETERS):
            n = len(out)
            params = dict(params, seed=1000 * p + q, stream=n % 3 == 1, ignore_eos=n % 3 != 2)
            out[f"{p}-{q}"] = (prompt, (1, 7, 33, 48)[n % 4] if n % 3 != 1 else 40, params)
            if n % 3 == 1:
                stopped[f"{p}-{q}"] = out[f"{p}-{q}"]
    for request_id, generated in generate_all(server, PLAIN, stopped).items():
        out[request_id][2]["stop_token_ids"] = [int(generated.output_ids[len(generated.output_ids) // 2])]
    return out


def generate_all(server, model: str, reqs, wave: int = 16) -> dict:
    """Send the requests on one gRPC stream, `wave` at a time (below Triton's queue bound), so they
    batch, join and leave together; each one's concatenated outputs by request id."""
    results, items = {}, list(reqs.items())
    with GenerateStream(server.grpc_url, model) as stream:
        for start in range(0, len(items), wave):
            for request_id, (prompt, budget, params) in items[start : start + wave]:
                stream.send(prompt, budget, request_id=request_id, **params)
            results.update(read_to_final(stream, len(items[start : start + wave])))
    for request_id, entry in results.items():
        assert entry["finals"] == 1 and not entry["errors"], (model, request_id, [e.message() for e in entry["errors"]])
    return {request_id: collect(entry["outputs"]) for request_id, entry in results.items()}


def assert_same(spec, plain, what: str) -> None:
    assert spec.finish_reason == plain.finish_reason, what
    for name in EXACT:
        np.testing.assert_array_equal(getattr(spec, name), getattr(plain, name), err_msg=f"{what}: {name}")
    for name in CLOSE:
        np.testing.assert_allclose(getattr(spec, name), getattr(plain, name), rtol=0, atol=1e-5, err_msg=name)


def test_ngram_returns_exactly_what_plain_decoding_returns(speculative_server):
    metrics = speculative_server.metrics_url
    before = {name: counter(metrics, name, NGRAM) for name in ("drafts", "drafted_tokens", "accepted_tokens")}
    reqs = requests(speculative_server)
    tokens_before = counter(metrics, "generate_tokens_total", NGRAM)
    plain = generate_all(speculative_server, PLAIN, reqs)
    spec = generate_all(speculative_server, NGRAM, reqs)
    for request_id, (_, _, params) in reqs.items():
        assert_same(spec[request_id], plain[request_id], f"{request_id} {params}")
        if params["stream"]:  # streamed as plain decoding streams: no response without a token
            assert all(len(r["output_ids"]) >= 1 for r in spec[request_id].responses)
    # The engine counts a step after sending its tokens (speculation first, then the tokens).
    wait_for_counter(
        metrics,
        "generate_tokens_total",
        lambda value: value >= tokens_before + sum(len(result.output_ids) for result in spec.values()),
        "the server never counted the tokens it sent",
        model=NGRAM,
    )
    finish = {result.finish_reason for result in plain.values()}
    assert finish == {"stop", "length"}, "the requests should end both ways"
    drafted = {
        name: counter(metrics, f"generate_spec_{name}_total", NGRAM) - before[name]
        for name in ("drafts", "drafted_tokens", "accepted_tokens")
    }
    # Drafts were made, some accepted (the repetitive prompts), some rejected.
    assert drafted["drafted_tokens"] > drafted["accepted_tokens"] > 0 and drafted["drafts"] > 0, drafted
    assert counter(metrics, "generate_spec_drafted_tokens_total", PLAIN) == 0


def test_http_generate_with_ngram_equals_plain(speculative_server):
    for prompt, params in ((REPETITIVE[0], PARAMETERS[1]), (OTHER[0], PARAMETERS[0])):
        results = [
            http_generate(speculative_server.http_url, prompt, 40, 128, model=model, seed=5, ignore_eos=True, **params)
            for model in (PLAIN, NGRAM)
        ]
        assert [status for status, _ in results] == [200, 200], results
        assert_same(results[1][1], results[0][1], str(prompt))


@pytest.mark.parametrize("model", [PLAIN, NGRAM])
def test_the_rl_example_replays_its_rollout_within_1e_5_in_float64(model, speculative_server, monkeypatch, capsys):
    """examples/rl_rollout.py against a float64 LM, plain and speculative: the trainer's replay
    over the returned masks gives importance ratios of 1 within 1e-5."""
    script = REPO_ROOT / "examples" / "rl_rollout.py"
    argv = [str(script), "--url", speculative_server.grpc_url, "--model", model, "--lm-dtype", "float64"]
    monkeypatch.setattr("sys.argv", argv)
    runpy.run_path(str(script), run_name="__main__")
    worst = float(re.search(r"over the masks ([-+.e0-9]+),", capsys.readouterr().out).group(1))
    assert worst < 1e-5


def test_masks_stay_refused_where_exactness_is_not_proven(speculative_server):
    status, body = http_generate(
        speculative_server.http_url, [5, 6, 7], 4, 128, model=EAGLE, top_k=5, return_sampling_mask=True
    )
    assert status == 400 and SPECULATIVE_MASK_MESSAGE in body["error"], body
    status, result = http_generate(speculative_server.http_url, [5, 6, 7], 4, 128, model=EAGLE, ignore_eos=True)
    assert status == 200 and len(result.output_ids) == 4  # generation itself goes on, without drafting
    client = httpclient.InferenceServerClient(speculative_server.http_url)
    try:
        logits = np.random.default_rng(0).standard_normal((1, 1000)).astype(np.float32)
        with pytest.raises(InferenceServerException) as refused:
            infer(client, httpclient, SAMPLER_NGRAM, logits, top_k=5, return_sampling_mask=True)
        assert refused.value.status() == "400" and SPECULATIVE_MASK_MESSAGE in refused.value.message()
    finally:
        client.close()
    log = speculative_server.log_tail(400_000)
    assert "speculative decoding: ngram (up to 4 drafted tokens" in log
    assert "speculative decoding: 'eagle' is not drafted here" in log
