"""Helpers shared by the reliability tests: expected errors, reference checks, server statistics."""

from __future__ import annotations

import json
import re
import urllib.request

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from testbed.server import infer
from tests.reference import reference_row

INVALID_ARGUMENT = {"400", "StatusCode.INVALID_ARGUMENT"}  # HTTP, gRPC
INTERNAL = {"500", "StatusCode.INTERNAL"}


def expect_error(send, statuses: set[str]) -> str:
    """Run `send()`, which must fail with one of `statuses`; returns the error message."""
    with pytest.raises(InferenceServerException) as caught:
        send()
    assert caught.value.status() in statuses, f"status {caught.value.status()}: {caught.value.message()}"
    return caught.value.message()


def check_against_reference(outputs: dict, logits: np.ndarray, temperature: float, top_k: int, want_mask: bool) -> None:
    """A valid answer agrees with the float64 reference: support, token inside it, log-probs."""
    for row, row_logits in enumerate(logits):
        ref = reference_row(row_logits, temperature=temperature, top_k=top_k)
        token = int(outputs["output_ids"][row, 0])
        length = int(outputs["sampling_mask_len"][row, 0])
        assert token in ref.support
        np.testing.assert_allclose(outputs["output_logprobs"][row, 0], ref.logprobs[token], atol=1e-4)
        if want_mask:
            assert length == len(ref.support)
            np.testing.assert_array_equal(outputs["sampling_mask"][row, :length], ref.support)
            assert (outputs["sampling_mask"][row, length:] == -1).all()
            expected = ref.renormalised_logprob(token, length)
            np.testing.assert_allclose(outputs["sampling_logprobs"][row, 0], expected, atol=1e-4)
        else:
            assert length == 0


def valid_request_succeeds(client, module, model: str = "sampler", seed: int = 0, want_mask: bool = True) -> None:
    """A small valid (mask) request is answered, and answered right."""
    logits = np.random.default_rng(seed).standard_normal((2, 64)).astype(np.float32)
    outputs = infer(client, module, model, logits, temperature=0.7, top_k=8, return_sampling_mask=want_mask)
    check_against_reference(outputs, logits, 0.7, 8, want_mask)


def model_stats(http_url: str, model: str = "sampler") -> dict:
    """The model's /v2/models/<model>/stats entry (inference counts, executions, batch sizes)."""
    with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/stats", timeout=10) as response:
        return json.loads(response.read())["model_stats"][0]


METRIC_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


def scrape(metrics_url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample on the Prometheus endpoint as {(name, frozenset(label items)): value}."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        match = METRIC_LINE.match(line)
        if match and not line.startswith("#"):
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
            samples[(match["name"], labels)] = float(match["value"])
    return samples
