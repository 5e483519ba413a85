"""prime-rl's generation path, verifiers 0.4.0's TrainClient (renderers 0.1.12), as shipped against the
front door: vLLM's POST /inference/v1/generate with token ids in, token ids, "token_id:N" log-probs
and (asked inside sampling_params, the only place a TrainClient user can put it) sampling masks out."""

from __future__ import annotations

from .conftest import run_driver
from .reference import assert_same_tokens, generate

SEED = 77


def test_train_client_gets_token_ids_logprobs_and_masks(api_url):
    sampling = {"max_tokens": 6, "temperature": 1.0, "top_k": 8, "seed": SEED, "return_sampling_mask": True}
    result = run_driver("verifiers_train", url=api_url, sampling=sampling)
    assert "error" not in result, result.get("traceback", result)
    ids, logprobs = result["completion_ids"], result["completion_logprobs"]
    assert len(ids) == len(logprobs) and 1 <= len(ids) <= 6
    expected = generate(api_url, result["prompt_ids"], len(ids), SEED, temperature=1.0, top_k=8)
    assert_same_tokens(ids, logprobs, expected)
    counts, flat = result["mask_counts"], result["mask_ids"]
    assert counts is not None, "no sampling_mask on choices[0]"
    rows, start = [], 0
    for count in counts:
        rows.append(sorted(flat[start : start + count]))
        start += count
    assert rows == [sorted(m) for m in expected["masks"][: len(ids)]]
