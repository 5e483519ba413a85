"""The API's field table is the one list of every request field: docs/api.md's tables are
generated from it, and each route's schema reads exactly the fields the table says it honours."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from triton_sampling_mask.api import field_table
from triton_sampling_mask.api.field_table import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    GENERATE_SAMPLING,
    TOKENS,
    TOKENS_SAMPLING,
    accept,
    docs_block,
    honoured_fields,
)
from triton_sampling_mask.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SGLangSamplingParams,
    TokenGenerateRequest,
    TokenSamplingParams,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_the_docs_tables_are_the_generated_ones():
    text = DOC.read_text()
    found = re.search(r"<!-- field-table:start -->\n(.*?)<!-- field-table:end -->", text, re.S)
    assert found, "docs/api.md has no field-table markers"
    assert found.group(1) == docs_block(), "regenerate: python -m triton_sampling_mask.api.field_table"


@pytest.mark.parametrize(
    ("route", "schema"),
    [
        (COMPLETIONS, CompletionRequest),
        (CHAT, ChatCompletionRequest),
        (GENERATE, GenerateRequest),
        (GENERATE_SAMPLING, SGLangSamplingParams),
        (TOKENS, TokenGenerateRequest),
        (TOKENS_SAMPLING, TokenSamplingParams),
    ],
)
def test_each_schema_reads_what_the_table_honours(route, schema):
    assert set(schema.model_fields) == honoured_fields(route)


def test_a_field_is_listed_once_per_route():
    seen = set()
    for rule in field_table.FIELD_RULES:
        assert (rule.route, rule.name) not in seen, rule
        seen.add((rule.route, rule.name))
        assert rule.handling in (field_table.HONOURED, field_table.NEUTRAL, field_table.IGNORED)


def test_neutral_values_compare_as_json():
    """true is not 1 and 0 is not false: a neutral 0 does not admit false."""
    with pytest.raises(Exception) as refused:
        accept(GENERATE, {"priority": False})
    assert refused.value.param == "priority"
    assert accept(GENERATE, {"priority": 0, "log_metrics": "anything", "text": "a"}) == {"text": "a"}
    assert accept(GENERATE_SAMPLING, {"repetition_penalty": 1.0}) == {}
