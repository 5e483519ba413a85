"""Custom metrics on Triton's Prometheus endpoint move exactly as the requests sent say."""

from __future__ import annotations

import numpy as np
import tritonclient.http as httpclient

from tests.reference import reference_row
from triton_sampling_mask.client.wire import infer_input as tensor
from triton_sampling_mask.serving.metrics import mask_length_buckets

from .reliability import INVALID_ARGUMENT, expect_error, scrape
from .server import infer

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
