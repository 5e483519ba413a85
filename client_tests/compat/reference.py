"""The independent reference the compat tests compare against: the API's SGLang `/generate` with the
same prompt ids and seed (its answer equals the generate model's, client_tests/test_sglang_api.py)."""

from __future__ import annotations

from .wire import post

LOGPROB_TOLERANCE = 1e-4


def generate(api_url: str, input_ids: list[int], max_new_tokens: int, seed: int, **sampling) -> dict:
    """meta_info of a seeded, masked /generate that ignores EOS (so it covers any stop a client asked for)."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "sampling_seed": seed, "ignore_eos": True, **sampling},
        "return_logprob": True,
        # masks need a finite top_k (the server's rule); without one the reference has none
        "return_sampling_mask": "top_k" in sampling,
    }
    status, answer = post(f"{api_url}/generate", body)
    assert status == 200, answer
    meta = answer["meta_info"]
    return {
        "ids": [entry[1] for entry in meta["output_token_logprobs"]],
        "logprobs": [entry[0] for entry in meta["output_token_logprobs"]],
        "masks": meta.get("output_token_sampling_mask"),
    }


def assert_same_tokens(ids, logprobs, expected: dict) -> None:
    """`ids` and `logprobs` are the reference's first len(ids) tokens (a stop may end a client's early)."""
    assert len(ids) >= 1, "no token generated"
    assert list(ids) == expected["ids"][: len(ids)], (ids, expected["ids"])
    for got, want in zip(logprobs, expected["logprobs"]):
        assert abs(got - want) <= LOGPROB_TOLERANCE, (logprobs, expected["logprobs"])
