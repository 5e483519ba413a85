"""The request bodies, strict: JSON types as declared (no "1" for 1, no true for 1), no NaN or
Infinity, and unknown fields refused by name. Fields OpenAI defines that the generate model has no
use for are accepted at their neutral value only (a penalty of 0, no logit bias, no tools), so a
client that sends its defaults is served and one that relies on them is told.

Extensions (documented in docs/api.md) follow the engines that introduced them: vLLM's `top_k`,
`min_p`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`, `return_token_ids`,
`add_generation_prompt`, `chat_template_kwargs`; SGLang's `return_sampling_mask`,
`sampling_logprobs_mode`, `return_meta_info`; this API's `sampling_mask_format` and `return_timings`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """What /v1/completions and /v1/chat/completions share."""

    model_config = STRICT

    model: str | None = None
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    return_sampling_mask: bool = False
    sampling_mask_format: Literal["lists", "compact"] = "lists"
    return_timings: bool = False  # this API's: each choice's `timings` (plugin/api/timings.py)
    # OpenAI's fields the generate model does not use: their neutral values only (routes check).
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Any = None  # a string, strings, token ids or lists of token ids: checked by the route
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's chat extensions: choice.meta_info (its /generate meta_info) and the masks' log-prob mode.
    return_meta_info: bool = False
    sampling_logprobs_mode: Literal["selected", "support"] = "selected"
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class SGLangSamplingParams(BaseModel):
    """SGLang's `sampling_params` (the knobs the generate model has)."""

    model_config = STRICT

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_new_tokens: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


class GenerateRequest(BaseModel):
    """SGLang's POST /generate (`GenerateReqInput`, the fields the generate model can honour)."""

    model_config = STRICT

    text: Any = None  # a string or strings
    input_ids: Any = None  # token ids or lists of them
    sampling_params: Any = None  # one SGLangSamplingParams or one per prompt: checked by the route
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False
    return_sampling_mask: bool = False
    sampling_logprobs_mode: Literal["selected", "support"] = "selected"
    return_timings: bool = False  # this API's: the generate model's timings in meta_info
    stream: bool = False
