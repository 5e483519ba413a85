"""The request bodies, as each route's upstream server parses them: the OpenAI routes and vLLM's
token route in pydantic's lax mode (`"8"` for 8, as vLLM takes them), SGLang's `/generate` with
the strict JSON types of SGLang's request contract. No route takes NaN or Infinity.

These models hold the fields this API honours; the fields accepted at a neutral value only, or
ignored, are checked and taken out first by `field_table.accept`, which is also the one list of
every field (docs/api.md is generated from it). Fields neither knows are ignored, except in
SGLang's `sampling_params`, which refuses them by name, as each upstream does.

Extensions (docs/api.md) follow the engines that introduced them: vLLM's `top_k`, `min_p`,
`stop_token_ids`, `ignore_eos`, `min_tokens`, `include_stop_str_in_output`, `return_token_ids`,
`return_tokens_as_token_ids`, `return_weight_versions`, ...; SGLang's `return_sampling_mask`,
`sampling_logprobs_mode`, `return_meta_info`, `no_stop_trim`; this API's `sampling_mask_format`
and `return_timings`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# vLLM's request models: pydantic's defaults (lax types), unknown fields ignored.
LAX = ConfigDict(extra="ignore", strict=False, allow_inf_nan=False)
# SGLang's request contract: JSON types as declared (an int is not "8"), unknown fields ignored...
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
# ...except in sampling_params, where SGLang refuses an unknown field by name.
STRICT_CLOSED = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = LAX
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(BaseModel):
    """What /v1/completions and /v1/chat/completions share."""

    model_config = LAX

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
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    return_tokens_as_token_ids: bool | None = False
    return_weight_versions: bool = False
    request_id: str | None = None
    return_sampling_mask: bool = False
    sampling_mask_format: Literal["lists", "compact"] = "lists"
    return_timings: bool = False  # this API's: each choice's `timings` (plugin/api/timings.py)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Any = None  # a string, strings, token ids or lists of token ids: checked by the route
    logprobs: int | None = Field(None, ge=0)
    best_of: int | None = None
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    model_config = LAX
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's chat extensions: choice.meta_info (its /generate meta_info), the masks' log-prob
    # mode, and its name for include_stop_str_in_output (sglang-router sends it on every request).
    return_meta_info: bool = False
    sampling_logprobs_mode: Literal["selected", "support"] = "selected"
    no_stop_trim: bool = False


class SGLangSamplingParams(BaseModel):
    """SGLang's `sampling_params` (the knobs the generate model has)."""

    model_config = STRICT_CLOSED

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_new_tokens: int | None = Field(None, ge=0)
    min_new_tokens: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    sampling_seed: int | None = None
    n: int | None = Field(1, ge=1)
    custom_params: dict[str, Any] | None = None  # slime's return_top_p_token_ids only (checked by the route)


class GenerateRequest(BaseModel):
    """SGLang's POST /generate (`GenerateReqInput`, the fields the generate model can honour)."""

    model_config = STRICT

    text: Any = None  # a string or strings
    input_ids: Any = None  # token ids or lists of them
    sampling_params: Any = None  # one SGLangSamplingParams or one per prompt: checked by the route
    rid: str | list[str] | None = None
    return_logprob: bool | None = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = False
    return_prompt_token_ids: bool = False
    return_sampling_mask: bool | None = False
    sampling_logprobs_mode: Literal["selected", "support"] | None = "selected"
    return_timings: bool = False  # this API's: the generate model's timings in meta_info
    stream: bool | None = False


class TokenSamplingParams(BaseModel):
    """vLLM's `SamplingParams` on its token route (the knobs the generate model has)."""

    model_config = LAX

    n: int = Field(1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = Field(None, ge=0)
    min_tokens: int = Field(0, ge=0)
    logprobs: int | None = Field(None, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # prime-rl's orchestrator sends it in sampling_params: true asks for masks (refused where the
    # support is unbounded), false for none; absent, a bounded support has masks (vLLM's flag).
    return_sampling_mask: bool | None = None


class TokenGenerateRequest(BaseModel):
    """vLLM's POST /inference/v1/generate (`GenerateRequest`, tokens in and out)."""

    model_config = LAX

    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)  # TokenSamplingParams, checked by the route
    request_id: str | None = None
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
