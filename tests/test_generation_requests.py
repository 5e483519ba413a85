"""A generation request's checks (request.check_generation_request): each refusal names its field
with the exact message a client sees, and every limit is tested on both sides of its boundary."""

from __future__ import annotations

import numpy as np
import pytest

from triton_sampling_mask.generation.request import MAX_STOP_TOKEN_IDS, check_generation_request
from triton_sampling_mask.sampling.validation import SamplingRequestError

VOCAB = 10
CONTEXT = 8


def ids(*values) -> np.ndarray:
    return np.array(values, np.int64)


def check(prompt=(1, 2), max_new_tokens=3, stops=(), vocab=VOCAB, context=CONTEXT) -> None:
    check_generation_request(ids(*prompt), max_new_tokens, ids(*stops), vocab, context)


def refusal(**fields) -> tuple[str, str]:
    with pytest.raises(SamplingRequestError) as caught:
        check(**fields)
    assert str(caught.value) == caught.value.message
    return caught.value.field, caught.value.message


def test_an_empty_prompt_is_refused():
    assert refusal(prompt=()) == ("input_ids", "input_ids must hold at least one token id")


def test_token_ids_at_both_ends_of_the_vocabulary_are_accepted():
    check(prompt=(0, VOCAB - 1), stops=(0, VOCAB - 1))
    check(prompt=(0,), max_new_tokens=0, stops=(0,))


@pytest.mark.parametrize(
    "prompt, bad",
    [((0, 3, VOCAB), VOCAB), ((0, -1), -1), ((VOCAB + 5, 0, -3), VOCAB + 5), ((2, -7, 99), -7)],
)
def test_a_prompt_id_outside_the_vocabulary_is_refused_naming_the_first(prompt, bad):
    assert refusal(prompt=prompt) == ("input_ids", f"input_ids must be token ids in [0, {VOCAB}), got {bad}")


@pytest.mark.parametrize("stops, bad", [((0, VOCAB), VOCAB), ((0, 4, -2), -2), ((2**40, 1), 2**40)])
def test_a_stop_id_outside_the_vocabulary_is_refused_naming_the_first(stops, bad):
    assert refusal(stops=stops) == ("stop_token_ids", f"stop_token_ids must be token ids in [0, {VOCAB}), got {bad}")


def test_the_prompt_is_checked_before_the_stop_ids():
    assert refusal(prompt=(0, -1), stops=(VOCAB,)) == (
        "input_ids",
        f"input_ids must be token ids in [0, {VOCAB}), got -1",
    )


def test_as_many_stop_ids_as_the_limit_are_accepted_and_one_more_is_refused():
    assert MAX_STOP_TOKEN_IDS == 1024
    check(stops=tuple(i % VOCAB for i in range(MAX_STOP_TOKEN_IDS)))
    too_many = tuple(i % VOCAB for i in range(MAX_STOP_TOKEN_IDS + 1))
    assert refusal(stops=too_many) == ("stop_token_ids", "stop_token_ids holds 1025 ids; at most 1024 are accepted")


def test_the_stop_ids_count_is_checked_before_their_values():
    too_many = (VOCAB,) * (MAX_STOP_TOKEN_IDS + 1)
    assert refusal(stops=too_many) == ("stop_token_ids", "stop_token_ids holds 1025 ids; at most 1024 are accepted")


def test_a_budget_of_zero_tokens_is_accepted_and_a_negative_one_refused():
    check(max_new_tokens=0)
    assert refusal(max_new_tokens=-1) == ("max_new_tokens", "max_new_tokens must be >= 0, got -1")
    assert refusal(max_new_tokens=-20) == ("max_new_tokens", "max_new_tokens must be >= 0, got -20")


def test_the_prompt_and_budget_may_fill_the_context_exactly():
    check(prompt=(1, 2, 3), max_new_tokens=CONTEXT - 3)
    check(prompt=(1,) * CONTEXT, max_new_tokens=0)
    assert refusal(prompt=(1, 2, 3), max_new_tokens=CONTEXT - 2) == (
        "max_new_tokens",
        f"prompt length 3 + max_new_tokens {CONTEXT - 2} exceeds the model's context length {CONTEXT}",
    )
    assert refusal(prompt=(1,) * (CONTEXT + 1), max_new_tokens=0) == (
        "max_new_tokens",
        f"prompt length {CONTEXT + 1} + max_new_tokens 0 exceeds the model's context length {CONTEXT}",
    )
