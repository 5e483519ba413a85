"""BatchSampler.run: many requests in one sampler call per vocabulary size, and back. Every output
of every answered request must be the one it gets when it is run alone, wherever the refused
requests sit in the batch (first, last, between, several rows each)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_sampling_mask.sampling.backends import TorchSamplingBackend
from triton_sampling_mask.sampling.batching import BatchSampler
from triton_sampling_mask.sampling.outputs import SAMPLED_OUTPUT_NAMES
from triton_sampling_mask.sampling.params import RowParams

WIDTH = 16


def request(rows: int, vocab: int, seed: int, bad: str | None = None, bad_row: int = 0, **overrides):
    """A seeded request of `rows` rows; `bad` makes row `bad_row` refused: "top_p" (a parameter
    rule, refused before sampling), "mask" (top_k above the mask width) or "nan" (a logits rule,
    refused after sampling)."""
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy((rng.standard_normal((rows, vocab)) * 2).astype(np.float32))
    params = RowParams.defaults(rows)
    params.temperature[:] = 0.9
    params.top_k[:] = rng.integers(1, WIDTH + 1, rows)
    params.top_p[:] = 0.9
    params.seed[:] = rng.integers(0, 2**63, rows).astype(np.uint64)
    params.has_seed[:] = True
    params.return_sampling_mask[:] = rng.random(rows) < 0.7
    for name, value in overrides.items():
        getattr(params, name)[:] = value
    if bad == "top_p":
        params.top_p[bad_row] = 0.0
    elif bad == "mask":
        params.top_k[bad_row], params.return_sampling_mask[bad_row] = WIDTH + 5, True
    elif bad == "nan":
        logits[bad_row, 3] = float("nan")
    return logits, params


@pytest.fixture(params=["cpu", "gpu"], ids=["cpu-ops", "gpu-ops-on-cpu"])
def batch_sampler(request):
    from triton_sampling_mask.sampling.validation import MaskPolicy

    backend = TorchSamplingBackend(fused=False, device_path=request.param)
    return BatchSampler(backend, MaskPolicy(WIDTH, "test"), torch.device("cpu"))


def check_batch(batch_sampler, requests, refused: set[int]):
    outcomes = batch_sampler.run(requests)
    assert len(outcomes) == len(requests)
    for position, (outcome, (logits, params)) in enumerate(zip(outcomes, requests)):
        alone = batch_sampler.run([(logits, params)])[0]
        if position in refused:
            assert outcome.error is not None and outcome.outputs is None, position
            assert outcome.error == alone.error and outcome.reason == alone.reason
            continue
        assert outcome.error is None, (position, outcome.error)
        assert set(outcome.outputs) == set(SAMPLED_OUTPUT_NAMES)
        # The receipt is each row's own seed, as it sent it (uint64, all 64 bits).
        np.testing.assert_array_equal(outcome.outputs["sampling_seed"].reshape(-1), params.seed)
        assert outcome.outputs["sampling_seed"].dtype == np.uint64
        for name in SAMPLED_OUTPUT_NAMES:
            value = outcome.outputs[name]
            assert value.shape[0] == logits.shape[0], (position, name, value.shape)
            np.testing.assert_array_equal(value, alone.outputs[name], err_msg=f"request {position}, {name}")


LAYOUTS = {
    "refused_first": ([(2, None), (3, None), (1, None)], {0}),
    "refused_last": ([(3, None), (1, None), (2, None)], {2}),
    "refused_between": ([(2, None), (3, None), (1, None), (4, None)], {1, 2}),
    "all_refused_but_one": ([(2, None), (1, None), (3, None)], {0, 2}),
    "every_other": ([(1, None), (3, None), (2, None), (2, None), (3, None)], {0, 2, 4}),
}


@pytest.mark.parametrize("bad", ["top_p", "mask", "nan"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_answers_are_the_requests_own_wherever_the_refused_ones_sit(batch_sampler, layout, bad):
    shapes, refused = LAYOUTS[layout]
    requests = [
        request(rows, 300, seed=position, bad=bad if position in refused else None, bad_row=rows - 1)
        for position, (rows, _) in enumerate(shapes)
    ]
    check_batch(batch_sampler, requests, refused)


def test_mixed_vocabularies_and_kinds_of_refusal(batch_sampler):
    requests = [
        request(2, 300, seed=1, bad="nan", bad_row=1),
        request(3, 500, seed=2),
        request(1, 300, seed=3),
        request(4, 500, seed=4, bad="top_p", bad_row=2),
        request(2, 300, seed=5, bad="mask", bad_row=0),
        request(3, 300, seed=6, top_k=-1, return_sampling_mask=False),  # the unranked rows
        request(2, 500, seed=7, temperature=0.0),
        request(1, 500, seed=8, bad="nan"),
    ]
    check_batch(batch_sampler, requests, {0, 3, 4, 7})


def test_a_refused_request_names_its_first_bad_row(batch_sampler):
    logits, params = request(4, 300, seed=9, bad="top_p", bad_row=2)
    params.top_p[3] = 2.0
    outcome = batch_sampler.run([request(1, 300, seed=1), (logits, params)])[1]
    assert outcome.error.startswith("top_p must be in (0, 1]") and outcome.error.endswith("(row 2)")
    assert outcome.reason == "top_p"


def test_an_unseeded_row_receives_the_seed_its_draw_used(batch_sampler):
    """Rows without a seed draw one on the server; the answer carries it, and sampling the same
    logits with that seed draws the same token (the receipt is what the noise used)."""
    logits, params = request(6, 400, seed=12)
    params.has_seed[::2] = False  # rows 0, 2, 4 unseeded
    outcome = batch_sampler.run([(logits, params)])[0]
    seeds = outcome.outputs["sampling_seed"].reshape(-1)
    np.testing.assert_array_equal(seeds[1::2], params.seed[1::2])
    assert len(set(seeds[::2].tolist()) - set(params.seed.tolist())) == 3  # fresh 64-bit draws
    replayed = params.with_seeds(seeds)
    replayed.has_seed[:] = True
    again = batch_sampler.run([(logits, replayed)])[0]
    for name in SAMPLED_OUTPUT_NAMES:
        np.testing.assert_array_equal(outcome.outputs[name], again.outputs[name], err_msg=name)
