"""Custom metrics on Triton's Prometheus endpoint move exactly as the requests sent say (the
sampler's and, under a real load of a few dozen requests, the generate model's)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from testbed.server import infer
from tests.reference import reference_row
from triton_sampling_mask.client.wire import infer_input as tensor
from triton_sampling_mask.serving.metrics import mask_length_buckets

from .generate_client import GenerateStream
from .reliability import INVALID_ARGUMENT, expect_error, scrape

MASK_WIDTH = 512  # dims of output sampling_mask in model_repository/sampler/config.pbtxt
LABELS = {"model": "sampler", "version": "1"}
# Valid mask requests: (temperature, top_k, min_p) for 2-row requests of varied support sizes.
MASK_REQUESTS = [(0.7, 3, 0.0), (1.0, 40, 0.2), (1.3, 300, 0.0)]
VOCAB = 1024


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset({**LABELS, **labels}.items())), 0.0)


def test_metrics_count_outcomes_mask_rows_lengths_and_time(triton_server, http_client):
    rng = np.random.default_rng(11)
    before = scrape(triton_server.metrics_url)
    lengths = []
    for temperature, top_k, min_p in MASK_REQUESTS:
        logits = rng.standard_normal((2, VOCAB)).astype(np.float32) * 2
        outputs = infer(
            http_client,
            httpclient,
            "sampler",
            logits,
            temperature=temperature,
            top_k=top_k,
            min_p=min_p,
            return_sampling_mask=True,
        )
        for row in logits:
            ref = reference_row(row, temperature=temperature, top_k=top_k, min_p=min_p)
            lengths.append(len(ref.support))
        np.testing.assert_array_equal(outputs["sampling_mask_len"][:, 0], lengths[-2:])
    infer(http_client, httpclient, "sampler", rng.standard_normal((1, VOCAB)).astype(np.float32))  # no mask
    bad = rng.standard_normal((1, VOCAB)).astype(np.float32)
    for _ in range(2):
        expect_error(lambda: infer(http_client, httpclient, "sampler", bad, top_p=0.0), INVALID_ARGUMENT)
    expect_error(lambda: infer(http_client, httpclient, "sampler", bad, return_sampling_mask=True), INVALID_ARGUMENT)
    no_logits = [tensor(httpclient, "temperature", np.ones((1, 1), np.float32), "FP32")]
    expect_error(lambda: http_client.infer("sampler", no_logits), INVALID_ARGUMENT)
    # Refused by Triton before the model runs: not the model's to count.
    wrong_dtype = [tensor(httpclient, "logits", bad.astype(np.float64), "FP64")]
    expect_error(lambda: http_client.infer("sampler", wrong_dtype), INVALID_ARGUMENT)
    after = scrape(triton_server.metrics_url)

    delta = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)  # noqa: E731
    assert delta("sampler_requests_total", outcome="ok", reason="ok") == len(MASK_REQUESTS) + 1
    assert delta("sampler_requests_total", outcome="rejected", reason="top_p") == 2
    assert delta("sampler_requests_total", outcome="rejected", reason="mask_unbounded") == 1
    assert delta("sampler_requests_total", outcome="rejected", reason="invalid_logits") == 1
    assert delta("sampler_requests_total", outcome="internal", reason="internal") == 0
    assert delta("sampler_mask_rows_total") == len(lengths)
    assert delta("sampler_mask_length_count") == len(lengths)
    assert delta("sampler_mask_length_sum") == sum(lengths)
    for bound in mask_length_buckets(MASK_WIDTH):
        assert delta("sampler_mask_length_bucket", le=str(bound)) == sum(n <= bound for n in lengths), bound
    assert delta("sampler_mask_length_bucket", le="+Inf") == len(lengths)
    # One sampler call per execute that parsed (requests went one at a time): the 4 answered and
    # the 3 refused by row rules; the one without logits never reached the sampler.
    assert delta("sampler_batches_total") == len(MASK_REQUESTS) + 1 + 3
    assert delta("sampler_compute_duration_us") > 0
    # The other models' series are their own.
    other = frozenset({"model": "sampler_speculative", "version": "1", "outcome": "ok", "reason": "ok"}.items())
    assert after.get(("sampler_requests_total", other), 0.0) == before.get(("sampler_requests_total", other), 0.0)


# A load on the session server's `generate` (plain decoding: one token per request per step).
GENERATE = {"model": "generate"}
MASKED = dict(temperature=0.8, top_k=20, top_p=0.9, return_sampling_mask=True, ignore_eos=True)
PLAIN = dict(temperature=0.8, ignore_eos=True)
LOAD = 36


def generate_value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset({**GENERATE, **labels}.items())), 0.0)


def bucket_bounds(samples: dict, name: str) -> list[float]:
    """The finite `le` bounds of a histogram's series, ascending."""
    bounds = {dict(labels)["le"] for key, labels in samples if key == f"{name}_bucket"}
    assert len(bounds) > 5, name
    return sorted(float(b) for b in bounds if b != "+Inf")


def test_generate_metrics_follow_a_real_load(triton_server):
    rng = np.random.default_rng(5)
    budgets = rng.integers(4, 40, LOAD).tolist()
    prompts = [rng.integers(3, 200, rng.integers(1, 9)).tolist() for _ in range(LOAD)]
    masked = [i % 2 == 0 for i in range(LOAD)]
    before = scrape(triton_server.metrics_url)
    sent, first, last, kept_mass, timings = {}, {}, {}, [], {}
    running_seen = 0.0
    with GenerateStream(triton_server.grpc_url) as stream:
        for i in range(LOAD):
            sent[str(i)] = time.monotonic()
            params = MASKED if masked[i] else PLAIN
            stream.send(prompts[i], budgets[i], request_id=str(i), stream=True, seed=i, **params)
        for bad in range(2):  # refused with a 400 before generation
            stream.send([5, 10**6], 3, request_id=f"bad{bad}")
        finals, errors = 0, []
        while finals < LOAD + 2:
            request_id, outputs, final, error = stream.next()
            now = time.monotonic()
            if error is not None:
                errors.append(error.message())
            if outputs is not None:
                first.setdefault(request_id, now)
                if "time_to_first_token_s" in outputs:  # the last response: the request's own timings
                    timings[request_id] = outputs
                last[request_id] = now
                if masked[int(request_id)]:
                    # -log(kept mass), as the server exports it (clipped at 0 against rounding).
                    # (every token of the response: one that caught up with the engine holds several)
                    kept_mass += [
                        max(float(kept) - float(sampled), 0.0)
                        for kept, sampled in zip(outputs["sampling_logprobs"], outputs["output_logprobs"])
                    ]
                if running_seen < 1 and finals < LOAD // 2:
                    # the load is on: requests run, the gauge says so (the engine sets it after the
                    # step whose tokens were just sent, so a scrape may come a step early: again)
                    running_seen = generate_value(scrape(triton_server.metrics_url), "generate_num_requests_running")
            finals += final
    assert len(errors) == 2 and all("input_ids" in message for message in errors), errors
    successes = lambda samples: generate_value(samples, "generate_request_success_total", finished_reason="length")  # noqa: E731
    after = wait_until_idle(
        triton_server.metrics_url, settled=lambda samples: successes(samples) - successes(before) >= LOAD
    )

    delta = lambda name, **labels: generate_value(after, name, **labels) - generate_value(before, name, **labels)  # noqa: E731
    e2e_client = np.array([last[k] - sent[k] for k in sent])
    ttft_client = np.array([first[k] - sent[k] for k in sent])
    assert running_seen >= 1
    assert generate_value(after, "generate_num_requests_running") == 0
    assert generate_value(after, "generate_num_requests_waiting") == 0
    # Counts are what was sent.
    assert delta("generate_request_success_total", finished_reason="length") == LOAD
    assert delta("generate_request_success_total", finished_reason="stop") == 0
    assert delta("generate_requests_rejected_total", reason="invalid") == 2
    assert delta("generate_requests_rejected_total", reason="capacity") == 0
    assert delta("generate_tokens_total") == sum(budgets)
    assert delta("generate_prompt_tokens_total") == sum(len(p) for p in prompts)
    for name in ("e2e_request_latency", "request_queue_time", "time_to_first_token"):
        assert delta(f"generate_{name}_seconds_count") == LOAD, name
    assert delta("generate_inter_token_latency_seconds_count") == sum(budgets) - LOAD
    assert delta("generate_neg_log_kept_mass_count") == len(kept_mass) == sum(b for b, m in zip(budgets, masked) if m)
    # Sums: the server's interval lies within the client's (send -> the response arrives).
    e2e_sum, ttft_sum = (
        delta("generate_e2e_request_latency_seconds_sum"),
        delta("generate_time_to_first_token_seconds_sum"),
    )
    itl_sum, queue_sum = (
        delta("generate_inter_token_latency_seconds_sum"),
        delta("generate_request_queue_time_seconds_sum"),
    )
    assert 0 < queue_sum <= ttft_sum <= ttft_client.sum()
    assert e2e_sum <= e2e_client.sum()
    assert e2e_sum == pytest.approx(ttft_sum + itl_sum, rel=1e-3)  # first token, then the gaps
    assert itl_sum >= 0.5 * (e2e_client - ttft_client).sum()
    # Histograms hold the measured latencies: at every bound, at least the requests the client saw
    # finish within it (the server's share of each request is the shorter).
    for name, measured in (("e2e_request_latency", e2e_client), ("time_to_first_token", ttft_client)):
        series = f"generate_{name}_seconds"
        for bound in bucket_bounds(after, series):
            at_most = delta(f"{series}_bucket", le=_le(after, series, bound))
            assert at_most >= (measured <= bound).sum(), (series, bound)
    # Each request's own timings (its last response) add up to the histograms' sums.
    assert sorted(timings) == sorted(sent)
    returned = {n: np.array([timings[k][n] for k in sent]) for n in ("queue_time_s", "time_to_first_token_s")}
    returned["e2e"] = np.array([timings[k]["queue_time_s"] + timings[k]["generation_time_s"] for k in sent])
    assert returned["queue_time_s"].sum() == pytest.approx(queue_sum, rel=1e-3)
    assert returned["time_to_first_token_s"].sum() == pytest.approx(ttft_sum, rel=1e-3)
    assert returned["e2e"].sum() == pytest.approx(e2e_sum, rel=1e-3)
    assert (returned["time_to_first_token_s"] <= ttft_client).all() and (returned["e2e"] <= e2e_client).all()
    # The kept mass: what the responses say, token by token (float32 outputs, summed here in float64).
    assert delta("generate_neg_log_kept_mass_sum") == pytest.approx(sum(kept_mass), abs=1e-3 * len(kept_mass))
    for bound in bucket_bounds(after, "generate_neg_log_kept_mass"):
        at_most = delta("generate_neg_log_kept_mass_bucket", le=_le(after, "generate_neg_log_kept_mass", bound))
        assert abs(at_most - sum(k <= bound for k in kept_mass)) <= sum(abs(k - bound) < 1e-5 for k in kept_mass)


def _le(samples: dict, series: str, bound: float) -> str:
    """The `le` label text of a bucket bound as the server writes it."""
    return next(
        dict(labels)["le"]
        for key, labels in samples
        if key == f"{series}_bucket" and dict(labels)["le"] != "+Inf" and float(dict(labels)["le"]) == bound
    )


def wait_until_idle(metrics_url: str, timeout_s: float = 10.0, settled=None) -> dict:
    """A scrape once the engine reports nothing running or waiting (it flushes its histograms then)
    and, with `settled`, once `settled(samples)` holds: the gauges may read 0 a moment before the
    last counts are sent."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(metrics_url)
        idle = all(generate_value(samples, f"generate_num_requests_{s}") == 0 for s in ("running", "waiting"))
        if (idle and (settled is None or settled(samples))) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def test_the_documented_triton_series_exist(triton_server):
    """docs/metrics.md's `nv_*` names (which the dashboard may query) are on a real server's endpoint."""
    documented = set(
        re.findall(r"`(nv_\w+)`", (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text())
    )
    opt_in = {"nv_inference_first_response_histogram_ms"}  # only with --metrics-config histogram_latencies=true
    served = {name for name, _ in scrape(triton_server.metrics_url)}
    assert documented - opt_in and documented - opt_in <= served, (documented - opt_in) - served


def series_sum(samples: dict, name: str, **labels) -> float:
    """The sum of every series `name` whose labels include `labels` (e.g. over Triton's `reason`)."""
    return sum(v for (key, have), v in samples.items() if key == name and set(labels.items()) <= have)


def send_control(stream: GenerateStream, command: str, request_id: str) -> None:
    control = grpcclient.InferInput("control", [1, 1], "BYTES")
    control.set_data_from_numpy(np.array([[command.encode()]], dtype=np.object_))
    stream.client.async_stream_infer("generate", [control], request_id=request_id, enable_empty_final_response=True)


def test_triton_counts_the_models_own_refusals_as_successes_and_ours_by_outcome(triton_server, http_client):
    """docs/metrics.md: Triton's nv_inference_request_success counts every request whose execute
    ran, the model's own 400s and 503s included; nv_inference_request_failure none of them. The
    models' own counters say how each request ended."""
    rng = np.random.default_rng(3)
    before = scrape(triton_server.metrics_url)
    logits = rng.standard_normal((1, VOCAB)).astype(np.float32)
    for _ in range(6):
        infer(http_client, httpclient, "sampler", logits, top_k=5)
    for _ in range(2):  # the model's own 400
        expect_error(lambda: infer(http_client, httpclient, "sampler", logits, top_p=0.0), INVALID_ARGUMENT)
    wrong_dtype = [tensor(httpclient, "logits", logits.astype(np.float64), "FP64")]  # Triton's own 400
    expect_error(lambda: http_client.infer("sampler", wrong_dtype), INVALID_ARGUMENT)
    answers = []
    with GenerateStream(triton_server.grpc_url) as stream:
        for i in range(3):
            stream.send([5, 6, 7], 2, request_id=f"ok{i}", temperature=0.0)
        for i in range(2):
            stream.send([5, 10**6], 2, request_id=f"bad{i}")  # the model's own 400
        send_control(stream, '{"op": "get_weight_version"}', "control-ok")
        send_control(stream, '{"op": "no_such_op"}', "control-bad")  # 400
        send_control(stream, '{"op": "pause_generation"}', "control-off")  # no admin key: UNAVAILABLE
        while len(answers) < 8:
            request_id, _, final, error = stream.next()
            if error is not None or final:
                answers.append("ok" if error is None else error.status())
    assert answers.count("ok") == 4, answers

    expected_ends = {("generation", "ok"): 3, ("generation", "invalid_arg"): 2, ("control", "ok"): 1}
    expected_ends |= {("control", "invalid_arg"): 1, ("control", "unavailable"): 1}

    def generate_ends(samples):
        return {
            key: generate_value(samples, "generate_requests_total", kind=key[0], outcome=key[1])
            for key in expected_ends
        }

    after = wait_until_idle(
        triton_server.metrics_url,
        settled=lambda samples: all(
            generate_ends(samples)[key] - generate_ends(before)[key] >= count for key, count in expected_ends.items()
        ),
    )
    delta = lambda name, **labels: series_sum(after, name, **labels) - series_sum(before, name, **labels)  # noqa: E731
    # Triton: the sampler's 6 answers and its 2 refusals are 8 successes, and no failure; the
    # request Triton refused itself, before any model ran (its input checks), is in neither.
    assert delta("nv_inference_request_success", model="sampler") == 8
    assert delta("nv_inference_request_failure", model="sampler") == 0
    assert delta("sampler_requests_total", model="sampler", outcome="ok") == 6
    assert delta("sampler_requests_total", model="sampler", outcome="rejected") == 2
    # The generate model: every request (generations and control requests, refused or not) is a
    # success to Triton, counted when execute returns; ours count each end by kind and outcome.
    assert delta("nv_inference_request_success", model="generate") == 8
    assert delta("nv_inference_request_failure", model="generate") == 0
    ours = {key: generate_ends(after)[key] - generate_ends(before)[key] for key in expected_ends}
    assert ours == expected_ends
