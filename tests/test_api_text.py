"""The HTTP API's text path without a server: the tiny LM's tokenizer (made to fit the LM's
config), incremental detokenization (whole characters, the same text as one decode), stop
strings (the earliest match, as a brute-force search finds it), the mask lists (the converters'
SGLang form) and the error mapping."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_sampling_mask.api.errors import from_generate_error
from triton_sampling_mask.api.text import IncrementalDetokenizer, StopStrings, context_length, load_tokenizer
from triton_sampling_mask.api.token_fields import sglang_mask_fields
from triton_sampling_mask.client import GenerateError, SampleResult
from triton_sampling_mask.client.converters import to_sglang
from triton_sampling_mask.generation.lm import DEFAULT_LM_CONFIG

LM_CONFIG = json.loads(DEFAULT_LM_CONFIG.read_text())
TOKENIZER = load_tokenizer("")
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


def test_the_tiny_tokenizer_fits_the_tiny_lm():
    assert len(TOKENIZER) == LM_CONFIG["vocab_size"]
    assert TOKENIZER.pad_token_id == LM_CONFIG["pad_token_id"]
    assert TOKENIZER.bos_token_id == LM_CONFIG["bos_token_id"]
    assert TOKENIZER.eos_token_id == LM_CONFIG["eos_token_id"]
    assert context_length("") == LM_CONFIG["max_position_embeddings"]
    prompt = TOKENIZER.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n") and "hi</s>" in prompt  # a turn ends with the LM's EOS


@settings(max_examples=60, deadline=None)
@given(TEXT)
def test_text_round_trips_and_streams_in_whole_characters(text):
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    pieces = [detokenizer.push(i) for i in ids]
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == text == TOKENIZER.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)  # no character split across tokens


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(3, LM_CONFIG["vocab_size"] - 1), max_size=30))
def test_any_ids_stream_to_what_one_decode_gives(ids):
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    streamed = "".join(detokenizer.push(i) for i in ids) + detokenizer.flush()
    assert streamed == TOKENIZER.decode(ids, skip_special_tokens=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text("abc", max_size=4), max_size=4), st.lists(st.text("abc", max_size=3), max_size=12))
def test_stop_strings_find_the_earliest_match_as_text_grows(stops, pieces):
    matcher = StopStrings(tuple(stops))
    text, found = "", None
    for piece in pieces:
        new_from, text = len(text), text + piece
        found = matcher.search(text, new_from)
        if found is not None:
            break
    hits = [(text.find(s), s) for s in stops if s and s in text]
    if not hits:
        assert found is None
    else:  # the brute force over the text at the moment of the match
        assert found is not None and found.position == min(at for at, _ in hits)
        assert text[found.position :].startswith(found.string)


@pytest.mark.parametrize(
    "error, status",
    [
        (
            GenerateError("in-band", "the generate model holds 4096 waiting requests (max_waiting 4096); retry with backoff"),
            503,
        ),
        (GenerateError(None, "could not reach the server: ConnectionRefusedError"), 503),
        (GenerateError("StatusCode.UNAVAILABLE", "the server closed the stream"), 503),
        (GenerateError("in-band", "input_ids must be token ids in [0, 1024), got 5000"), 400),
        (GenerateError("StatusCode.INTERNAL", "boom"), 502),
    ],
)
def test_generate_errors_map_to_statuses(error, status):
    answer = from_generate_error(error, retry_after_s=2)
    assert answer.status == status and error.message in answer.message
    assert (answer.retry_after_s == 2) == (status == 503)
    assert set(answer.body()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 6), st.integers(0, 2**32 - 1))
def test_mask_lists_are_the_converters_sglang_form(tokens, seed):
    rng = np.random.default_rng(seed)
    width = 8
    lengths = rng.integers(1, width + 1, tokens).astype(np.int32)
    mask = np.full((tokens, width), -1, np.int32)
    support = np.full((tokens, width), -np.inf, np.float32)
    for row, n in enumerate(lengths):  # test data only
        mask[row, :n] = rng.permutation(50)[:n]
        support[row, :n] = -rng.random(n)
    sampled = -rng.random(tokens).astype(np.float32)
    result = SampleResult(mask[:, 0].copy(), sampled, mask, lengths, sampled, support)
    assert sglang_mask_fields(result) == to_sglang(mask, lengths, sampled, support)
