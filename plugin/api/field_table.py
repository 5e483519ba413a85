"""Every request field the upstream servers define, per route, and what this API does with it:
the one table docs/api.md's field tables are generated from (`docs_block`, checked by a test).

A field is *honoured* (the route's schema reads it and it does here what it does upstream),
*neutral* (accepted at the listed values, which ask for nothing this server lacks; any other value
is a 400 naming the field and saying why) or *ignored* (any value is accepted: it changes nothing
in the answer here, e.g. a metrics switch or a prefix-cache key on an engine without a prefix
cache). Neutral and ignored fields are taken out of the body by `accept` before the schema sees
it; what neither the table nor the schema knows follows the upstream server of that route
(`UNKNOWN_FIELDS`).

Sources: vLLM's `CompletionRequest`, `ChatCompletionRequest`, the token route's `GenerateRequest`
and `SamplingParams`; SGLang's `GenerateReqInput` and sampling parameters; the fields
sglang-router and smg re-serialise into every request they forward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import bad_request

HONOURED, NEUTRAL, IGNORED = "honoured", "neutral", "ignored"

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OPENAI = "/v1/completions and /v1/chat/completions"
GENERATE, GENERATE_SAMPLING = "/generate", "/generate sampling_params"
TOKENS, TOKENS_SAMPLING = "/inference/v1/generate", "/inference/v1/generate sampling_params"
ROUTES = (OPENAI, COMPLETIONS, CHAT, GENERATE, GENERATE_SAMPLING, TOKENS, TOKENS_SAMPLING)
# The routes whose fields a route also takes (the OpenAI routes share most of theirs).
_SHARED = {COMPLETIONS: (OPENAI,), CHAT: (OPENAI,)}

# What each route does with a field neither the table nor its schema knows, as its upstream does.
UNKNOWN_FIELDS = {
    OPENAI: "ignored, as vLLM's OpenAI server ignores them (it logs them at debug level)",
    GENERATE: "ignored, as SGLang's `GenerateReqInput` ignores them",
    GENERATE_SAMPLING: "refused by name (400), as SGLang refuses an unknown sampling parameter",
    TOKENS: "ignored, as vLLM's token route ignores them",
    TOKENS_SAMPLING: "ignored, as vLLM's `SamplingParams` ignores them on the token route",
}

_NO_PENALTIES = "the generate model samples without penalties"
_NO_GRAMMAR = "the generate model has no constrained decoding"
_NO_MEDIA = "the generate model reads text token ids only"
_NO_PREFIX_CACHE = "the engine keeps no prefix cache, so cache keys change nothing"
_NO_TOP = "top alternatives are not computed (return_sampling_mask gives every support token's log-prob)"
_ONE_ENGINE = "one engine, no data-parallel ranks or disaggregation"
_NO_REASONING = "no reasoning parser runs: the text is never split"
_PER_TOKEN = "answers stream one event per engine response (a token, or every token made while the last event waited)"


@dataclass(frozen=True)
class FieldRule:
    """One field of one route: where it comes from, what is done with it, its neutral values."""

    route: str
    name: str
    source: str
    handling: str
    note: str
    neutral: tuple = ()


def _rules(route: str, source: str, handling: str, note: str, names: str, neutral: tuple = ()) -> list[FieldRule]:
    return [FieldRule(route, name, source, handling, note, neutral) for name in names.split()]


def _honoured(route: str, source: str, rows: dict[str, str]) -> list[FieldRule]:
    return [FieldRule(route, name, source, HONOURED, note) for name, note in rows.items()]


NULL, FALSE, EMPTY, ZERO = (None,), (None, False), (None, [], {}), (None, 0)

FIELD_RULES: tuple[FieldRule, ...] = tuple(
    # -- OpenAI dialect: both routes (vLLM's request models) --
    _honoured(
        OPENAI,
        "OpenAI",
        {
            "model": "null or the served model name (404 otherwise)",
            "n": "choices per prompt; choice j of a seeded request is seeded with seed + j",
            "max_tokens": "new-token budget (completions default 16; chat: the context's room)",
            "temperature": "the sampler's temperature",
            "top_p": "the sampler's top_p",
            "seed": "the request's 64-bit seed",
            "stop": "stop strings, matched on the text",
            "stream": "Server-Sent Events, one per engine response (one token or more)",
            "stream_options": "include_usage, continuous_usage_stats",
        },
    )
    + _rules(OPENAI, "OpenAI", IGNORED, "end users are not tracked", "user")
    + _honoured(
        OPENAI,
        "vLLM",
        {
            "top_k": "the sampler's top_k; 0 and -1 mean off (the whole vocabulary)",
            "min_p": "the sampler's min_p",
            "stop_token_ids": "ids that end a sequence (kept in token_ids)",
            "ignore_eos": "do not stop at EOS",
            "min_tokens": "no EOS, stop id or stop string ends a sequence before this many tokens; "
            "above 0 it needs ignore_eos and no stop_token_ids (the generate model cannot forbid them)",
            "skip_special_tokens": "leave special tokens out of the text (default true)",
            "spaces_between_special_tokens": "passed to the tokenizer's decode",
            "include_stop_str_in_output": "keep the stop string (or stop token's text) in the text",
            "return_token_ids": "prompt_token_ids and token_ids",
            "return_tokens_as_token_ids": "log-prob tokens as `token_id:N`",
            "return_weight_versions": "each choice's weight_versions spans (streamed: on its last chunk)",
            "request_id": "the response id's suffix",
        },
    )
    + _honoured(
        OPENAI,
        "SGLang",
        {"return_sampling_mask": "per choice sampling_mask, sampling_mask_logprobs, sampling_logprobs"},
    )
    + _honoured(
        OPENAI,
        "this API",
        {
            "sampling_mask_format": '"lists" or "compact"',
            "return_timings": "each choice's timings",
        },
    )
    + _rules(OPENAI, "OpenAI", NEUTRAL, _NO_PENALTIES, "presence_penalty frequency_penalty", (None, 0))
    + _rules(OPENAI, "OpenAI", NEUTRAL, "no logit bias is applied", "logit_bias", EMPTY)
    + _rules(OPENAI, "OpenAI", NEUTRAL, _NO_GRAMMAR, "response_format", (None, {"type": "text"}))
    + _rules(OPENAI, "vLLM", NEUTRAL, _NO_PENALTIES, "repetition_penalty", (None, 1))
    + _rules(OPENAI, "vLLM", NEUTRAL, "no beam search", "use_beam_search", FALSE)
    + _rules(OPENAI, "vLLM", NEUTRAL, "no beam search", "length_penalty", (None, 1))
    + _rules(OPENAI, "vLLM", NEUTRAL, "no watermarking", "watermarking", FALSE)
    + _rules(OPENAI, "vLLM", NEUTRAL, "prompts are never truncated", "truncate_prompt_tokens", NULL)
    + _rules(OPENAI, "vLLM", IGNORED, "prompts are never truncated", "truncation_side")
    + _rules(OPENAI, "vLLM", NEUTRAL, _NO_GRAMMAR, "allowed_token_ids structured_outputs", NULL)
    + _rules(OPENAI, "vLLM", NEUTRAL, _NO_GRAMMAR, "bad_words", (None, []))
    + _rules(OPENAI, "vLLM", NEUTRAL, "prompt log-probs are not computed", "prompt_logprobs", NULL)
    + _rules(OPENAI, "vLLM", NEUTRAL, _NO_TOP, "logprob_token_ids", NULL)
    + _rules(OPENAI, "vLLM", NEUTRAL, "one queue, no priorities", "priority", ZERO)
    + _rules(OPENAI, "vLLM", IGNORED, _NO_PREFIX_CACHE, "cache_salt")
    + _rules(OPENAI, "vLLM", IGNORED, "requests carry no session state", "session_id")
    + _rules(OPENAI, "vLLM", NEUTRAL, "token offsets are not computed", "return_token_offsets", FALSE)
    + _rules(OPENAI, "vLLM", IGNORED, "no routed experts are returned", "routed_experts_prompt_start")
    + _rules(OPENAI, "vLLM", NEUTRAL, _NO_MEDIA, "mm_payload", NULL)
    + _rules(OPENAI, "vLLM", NEUTRAL, _NO_MEDIA, "return_mm_kwargs", FALSE)
    + _rules(OPENAI, "vLLM", NEUTRAL, _ONE_ENGINE, "kv_transfer_params ec_transfer_params", NULL)
    + _rules(OPENAI, "vLLM", NEUTRAL, "no custom sampler arguments", "vllm_xargs", NULL)
    + _rules(OPENAI, "vLLM", NEUTRAL, "no repetition detection", "repetition_detection", NULL)
    + _rules(OPENAI, "vLLM", NEUTRAL, "no thinking budget is enforced", "thinking_token_budget", NULL)
    + _rules(OPENAI, "vLLM", IGNORED, _PER_TOKEN, "stream_interval")
    # -- /v1/completions only --
    + _honoured(
        COMPLETIONS,
        "OpenAI",
        {
            "prompt": "a string, strings, token ids or lists of token ids",
            "logprobs": "0: the sampled token's log-prob (top_logprobs lists it alone); more is refused",
        },
    )
    + _honoured(
        COMPLETIONS,
        "vLLM",
        {
            "add_special_tokens": "encode string prompts with special tokens (default true)",
            "best_of": "must equal n",
        },
    )
    + _rules(COMPLETIONS, "OpenAI", NEUTRAL, "the prompt is not echoed", "echo", FALSE)
    + _rules(COMPLETIONS, "OpenAI", NEUTRAL, "no suffix insertion", "suffix", (None, ""))
    + _rules(COMPLETIONS, "vLLM", NEUTRAL, _NO_MEDIA, "prompt_embeds", NULL)
    # -- /v1/chat/completions only --
    + _honoured(
        CHAT,
        "OpenAI",
        {
            "messages": "string content or text parts, rendered with the checkpoint's chat template",
            "max_completion_tokens": "new-token budget",
            "logprobs": "the sampled token's log-prob per token",
            "top_logprobs": "0 only (" + _NO_TOP + ")",
        },
    )
    + _honoured(
        CHAT,
        "vLLM",
        {
            "add_generation_prompt": "the template's generation prompt (default true)",
            "continue_final_message": "leave the last message open to be continued",
            "add_special_tokens": "encode the rendered prompt with special tokens (default false)",
            "chat_template_kwargs": "extra template variables",
        },
    )
    + _honoured(
        CHAT,
        "SGLang",
        {
            "return_meta_info": "choice.meta_info as /generate's and choice.response_token_ids",
            "sampling_logprobs_mode": '"selected" or "support"',
            "no_stop_trim": "as include_stop_str_in_output",
        },
    )
    + _rules(CHAT, "OpenAI", NEUTRAL, "no tool calling", "tools", (None, []))
    + _rules(CHAT, "OpenAI", NEUTRAL, "no tool calling", "tool_choice", (None, "none", "auto"))
    + _rules(CHAT, "OpenAI", IGNORED, "no tool calling", "parallel_tool_calls")
    + _rules(CHAT, "OpenAI", NEUTRAL, "no reasoning control", "reasoning_effort", NULL)
    + _rules(CHAT, "vLLM", IGNORED, _NO_REASONING, "include_reasoning")
    + _rules(CHAT, "vLLM", NEUTRAL, "the prompt is not echoed", "echo", FALSE)
    + _rules(CHAT, "vLLM", NEUTRAL, "the checkpoint's own chat template renders the messages", "chat_template", NULL)
    + _rules(CHAT, "vLLM", NEUTRAL, "no documents are passed to the template", "documents", NULL)
    + _rules(CHAT, "vLLM", NEUTRAL, _NO_MEDIA, "media_io_kwargs mm_processor_kwargs", NULL)
    + _rules(CHAT, "vLLM", NEUTRAL, "the prompt text is not returned", "return_prompt_text", FALSE)
    + _rules(CHAT, "SGLang (sglang-router)", IGNORED, _NO_REASONING, "separate_reasoning stream_reasoning")
    # -- SGLang's /generate (GenerateReqInput) --
    + _honoured(
        GENERATE,
        "SGLang",
        {
            "text": "a string or strings",
            "input_ids": "token ids or lists of them",
            "sampling_params": "one object for every prompt or one per prompt",
            "rid": "the sequence ids (a batch's: a list, or a prefix)",
            "stream": "cumulative Server-Sent Events",
            "return_logprob": "meta_info.output_token_logprobs",
            "logprob_start_len": "-1 or null only: prompt log-probs are not computed",
            "top_logprobs_num": "0 or null only: " + _NO_TOP,
            "return_text_in_logprobs": "each log-prob entry's token text",
            "return_prompt_token_ids": "prompt_token_ids on the answer",
            "return_sampling_mask": "meta_info's sampling masks",
            "sampling_logprobs_mode": '"selected" or "support"',
        },
    )
    + _rules(
        GENERATE,
        "sglang-router, smg",
        IGNORED,
        'not an SGLang field (SGLang ignores it): routers add it, smg 1.13 as "unknown"',
        "model",
    )
    + _honoured(GENERATE, "this API", {"return_timings": "the generate model's timings in meta_info"})
    + _rules(GENERATE, "SGLang", NEUTRAL, _NO_MEDIA, "image_data video_data audio_data modalities", (None, []))
    + _rules(
        GENERATE,
        "SGLang",
        NEUTRAL,
        _NO_MEDIA,
        "input_embeds mm_hashes mm_content_hashes video_config images_config mm_processor_kwargs "
        "max_dynamic_patch min_dynamic_patch image_max_dynamic_patch video_max_dynamic_patch "
        "positional_embed_overrides",
        NULL,
    )
    + _rules(GENERATE, "SGLang", NEUTRAL, _NO_MEDIA, "use_audio_in_video", FALSE)
    + _rules(GENERATE, "SGLang", NEUTRAL, _NO_TOP, "token_ids_logprob", NULL)
    + _rules(
        GENERATE,
        "SGLang",
        NEUTRAL,
        _NO_TOP,
        "return_flat_raw_top_logprobs return_flat_raw_output_top_logprobs return_flat_raw_top_logprobs_b64",
        FALSE,
    )
    + _rules(GENERATE, "SGLang", IGNORED, "metrics are kept by the server for every request", "log_metrics")
    + _rules(GENERATE, "SGLang", NEUTRAL, "hidden states are not returned", "return_hidden_states", FALSE)
    + _rules(GENERATE, "SGLang", NEUTRAL, "the LM is not a mixture of experts", "return_routed_experts", FALSE)
    + _rules(GENERATE, "SGLang", IGNORED, "no routed experts are returned", "routed_experts_start_len")
    + _rules(GENERATE, "SGLang", NEUTRAL, "no sparse-attention indexer", "return_indexer_topk", FALSE)
    + _rules(GENERATE, "SGLang", NEUTRAL, "requests carry no session state", "session_params", NULL)
    + _rules(GENERATE, "SGLang", IGNORED, "requests carry no session state", "session_id conversation_id")
    + _rules(GENERATE, "SGLang", NEUTRAL, "no LoRA adapters", "lora_path lora_id", NULL)
    + _rules(GENERATE, "SGLang", NEUTRAL, "no custom logit processors", "custom_logit_processor", NULL)
    + _rules(
        GENERATE,
        "SGLang",
        NEUTRAL,
        _ONE_ENGINE,
        "bootstrap_host bootstrap_port bootstrap_room bootstrap_pair_key decode_tp_size disagg_prefill_dp_rank "
        "kv_hints need_wait_for_mm_inputs num_items_assigned encoder_urls http_worker_ipc",
        NULL,
    )
    + _rules(GENERATE, "SGLang", NEUTRAL, _ONE_ENGINE, "routed_dp_rank data_parallel_rank", ZERO)
    + _rules(GENERATE, "SGLang", IGNORED, _ONE_ENGINE, "routing_key")
    + _rules(GENERATE, "SGLang", NEUTRAL, "no background responses", "background", FALSE)
    + _rules(GENERATE, "SGLang", NEUTRAL, "no reasoning control", "require_reasoning", FALSE)
    + _rules(GENERATE, "SGLang", NEUTRAL, "no thinking budget is enforced", "max_thinking_tokens", NULL)
    + _rules(GENERATE, "SGLang", NEUTRAL, "one queue, no priorities", "priority", ZERO)
    + _rules(GENERATE, "SGLang", IGNORED, _NO_PREFIX_CACHE, "extra_key cache_salt")
    + _rules(GENERATE, "SGLang", IGNORED, "this API logs no request content", "no_logs")
    + _rules(GENERATE, "SGLang", IGNORED, "no per-request metric labels", "custom_labels")
    + _rules(GENERATE, "SGLang", NEUTRAL, "no image generation", "return_bytes", FALSE)
    + _rules(GENERATE, "SGLang", NEUTRAL, "entropies are not computed", "return_entropy", FALSE)
    + _rules(GENERATE, "SGLang", IGNORED, "tracing context is taken from HTTP headers", "external_trace_header")
    + _rules(GENERATE, "SGLang", IGNORED, "the API's own clock times requests", "received_time")
    + _rules(GENERATE, "SGLang", NEUTRAL, "no watermarking", "watermark", NULL)
    + _rules(GENERATE, "SGLang", NEUTRAL, "no scoring", "multi_item_delimiter_indices token_indices_to_pool", NULL)
    # -- SGLang's sampling_params --
    + _honoured(
        GENERATE_SAMPLING,
        "SGLang",
        {
            "max_new_tokens": "new-token budget (default 128, within the context)",
            "temperature": "the sampler's temperature",
            "top_p": "the sampler's top_p",
            "top_k": "the sampler's top_k; -1 (and 1073741824, SGLang's 'all') mean off",
            "min_p": "the sampler's min_p",
            "stop": "stop strings",
            "stop_token_ids": "ids that end a sequence (kept in output_ids)",
            "ignore_eos": "do not stop at EOS",
            "min_new_tokens": "as vLLM's min_tokens",
            "skip_special_tokens": "leave special tokens out of the text (default true)",
            "spaces_between_special_tokens": "passed to the tokenizer's decode",
            "no_stop_trim": "keep the stop string (or stop token's text) in the text",
            "sampling_seed": "the sequence's 64-bit seed",
            "n": "sequences per prompt",
        },
    )
    + _honoured(
        GENERATE_SAMPLING,
        "slime",
        {
            "custom_params": "only `{\"return_top_p_token_ids\": true}` (slime's top-p replay): each token's sampling "
            "mask as meta_info.top_p_token_ids and top_p_token_offsets; a mask, so it needs a finite top_k",
        },
    )
    + _rules(GENERATE_SAMPLING, "SGLang", NEUTRAL, _NO_PENALTIES, "frequency_penalty presence_penalty", (None, 0))
    + _rules(GENERATE_SAMPLING, "SGLang", NEUTRAL, _NO_PENALTIES, "repetition_penalty", (None, 1))
    + _rules(GENERATE_SAMPLING, "SGLang", NEUTRAL, _NO_GRAMMAR, "json_schema regex ebnf structural_tag", NULL)
    + _rules(GENERATE_SAMPLING, "SGLang", NEUTRAL, _NO_GRAMMAR, "stop_regex choice", (None, []))
    + _rules(GENERATE_SAMPLING, "SGLang", NEUTRAL, "no logit bias is applied", "logit_bias", EMPTY)
    + _rules(GENERATE_SAMPLING, "SGLang", NEUTRAL, "no beam search", "beam_width", NULL)
    + _rules(GENERATE_SAMPLING, "SGLang", NEUTRAL, "no watermarking", "watermark", NULL)
    + _rules(GENERATE_SAMPLING, "SGLang", IGNORED, _PER_TOKEN, "stream_interval")
    # -- vLLM's token route (GenerateRequest) --
    + _honoured(
        TOKENS,
        "vLLM",
        {
            "token_ids": "the prompt's token ids",
            "sampling_params": "vLLM's sampling parameters (below)",
            "request_id": "the answer's request_id, and the id /inference/v1/abort_requests takes",
            "model": "null or the served model name (404 otherwise)",
            "stream": "Server-Sent Events of token deltas",
            "stream_options": "include_usage, continuous_usage_stats",
            "return_token_ids": "prompt_token_ids on the answer (streamed: the first chunk)",
        },
    )
    + _rules(TOKENS, "vLLM", NEUTRAL, _NO_MEDIA, "features content_parts", NULL)
    + _rules(TOKENS, "vLLM", IGNORED, "informational: the prompt is given as ids", "token_offsets")
    + _rules(TOKENS, "vLLM", NEUTRAL, _NO_REASONING, "reasoning_ended reasoning_parser_kwargs", NULL)
    + _rules(TOKENS, "vLLM", NEUTRAL, "answers carry token ids only", "output_mode", (None, "tokens"))
    + _rules(TOKENS, "vLLM", IGNORED, "read by vLLM only when output_mode is derender", "parse_context")
    + _rules(TOKENS, "vLLM", IGNORED, _NO_PREFIX_CACHE, "cache_salt")
    + _rules(TOKENS, "vLLM", NEUTRAL, "one queue, no priorities", "priority", ZERO)
    + _rules(TOKENS, "vLLM", NEUTRAL, _ONE_ENGINE, "kv_transfer_params ec_transfer_params", NULL)
    # -- vLLM's SamplingParams on the token route --
    + _honoured(
        TOKENS_SAMPLING,
        "vLLM",
        {
            "n": "sequences per prompt",
            "temperature": "the sampler's temperature",
            "top_p": "the sampler's top_p",
            "top_k": "the sampler's top_k; 0 and -1 mean off. A finite top_k returns sampling_mask",
            "min_p": "the sampler's min_p",
            "seed": "the request's 64-bit seed",
            "stop": "stop strings, matched on the decoded text",
            "stop_token_ids": "ids that end a sequence (kept in token_ids)",
            "ignore_eos": "do not stop at EOS",
            "max_tokens": "new-token budget (default: the context's room)",
            "min_tokens": "as on the OpenAI routes",
            "logprobs": "null: none; 0 or more: logprobs.content with the sampled token's log-prob first in "
            "top_logprobs, then the support's most probable ids when sampling_mask is computed",
            "skip_special_tokens": "decoding stop strings' text",
            "spaces_between_special_tokens": "decoding stop strings' text",
            "include_stop_str_in_output": "accepted (token ids are returned whole either way)",
        },
    )
    + _honoured(
        TOKENS_SAMPLING,
        "prime-rl",
        {
            "return_sampling_mask": "true: masks, refused for an unbounded support (no finite top_k); false: none; "
            "absent: masks whenever the support is bounded"
        },
    )
    + _rules(
        TOKENS_SAMPLING, "vLLM", IGNORED, "answers carry token ids; text is decoded for stop strings only", "detokenize"
    )
    + _rules(TOKENS_SAMPLING, "vLLM", IGNORED, "whole answers when not streamed, deltas when streamed", "output_kind")
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, _NO_PENALTIES, "presence_penalty frequency_penalty", (None, 0))
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, _NO_PENALTIES, "repetition_penalty", (None, 1))
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, "no watermarking", "watermarking", FALSE)
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, "prompt log-probs are not computed", "prompt_logprobs", NULL)
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, "prompt log-probs are not computed", "prompt_logprob_start", NULL)
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, _NO_TOP, "logprob_token_ids", NULL)
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, _NO_TOP, "flat_logprobs", FALSE)
    + _rules(TOKENS_SAMPLING, "vLLM", IGNORED, _PER_TOKEN, "stream_interval")
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, _NO_GRAMMAR, "structured_outputs allowed_token_ids logit_bias", NULL)
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, _NO_GRAMMAR, "bad_words", (None, []))
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, "no custom sampler arguments", "extra_args", NULL)
    + _rules(TOKENS_SAMPLING, "vLLM", IGNORED, _NO_PREFIX_CACHE, "skip_reading_prefix_cache")
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, "no thinking budget is enforced", "thinking_token_budget", NULL)
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, "no repetition detection", "repetition_detection", NULL)
    + _rules(TOKENS_SAMPLING, "vLLM", IGNORED, "no routed experts are returned", "routed_experts_prompt_start")
    + _rules(TOKENS_SAMPLING, "vLLM", NEUTRAL, "tokens are sampled, never forced", "trace_decode_token_ids", NULL)
    + _rules(TOKENS_SAMPLING, "vLLM", IGNORED, "an engine-internal copy switch", "skip_clone")
)


def _rules_of(route: str) -> dict[str, FieldRule]:
    rules: dict[str, FieldRule] = {}
    for shared in _SHARED.get(route, ()):
        rules.update({r.name: r for r in FIELD_RULES if r.route == shared})
    rules.update({r.name: r for r in FIELD_RULES if r.route == route})
    return rules


_BY_ROUTE = {route: _rules_of(route) for route in ROUTES}


def honoured_fields(route: str) -> set[str]:
    """The names a route's schema reads (for the test that checks schema and table agree)."""
    return {name for name, rule in _BY_ROUTE[route].items() if rule.handling == HONOURED}


def _same(value, neutral) -> bool:
    """JSON equality: true is not 1, 1.0 is 1."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return isinstance(value, bool) and isinstance(neutral, bool) and value == neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def accept(route: str, body: dict, prefix: str = "") -> dict:
    """`body` without the route's neutral and ignored fields, each checked: a neutral field at any
    other value is a 400 naming it (`prefix` + name) and saying why. Honoured and unknown fields
    are left for the route's schema."""
    rules = _BY_ROUTE[route]
    kept = {}
    for name, value in body.items():
        rule = rules.get(name)
        if rule is None or rule.handling == HONOURED:
            kept[name] = value
        elif rule.handling == NEUTRAL and not any(_same(value, n) for n in rule.neutral):
            where = f"{prefix}{name}"
            allowed = " or ".join(json.dumps(n) for n in rule.neutral)
            raise bad_request(f"{where}={_shown(value)} is not supported: {rule.note} (accepted: {allowed})", where)
    return kept


def _shown(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _cell(rule: FieldRule) -> str:
    if rule.handling == NEUTRAL:
        return "only " + " or ".join(f"`{json.dumps(n)}`" for n in rule.neutral) + f": {rule.note}"
    if rule.handling == IGNORED:
        return f"any value, no effect: {rule.note}"
    return rule.note


def docs_block() -> str:
    """docs/api.md's field tables (between its field-table markers), generated from FIELD_RULES."""
    parts = []
    for route in ROUTES:
        rows = [r for r in FIELD_RULES if r.route == route]
        parts.append(
            f"**{route}**" + (f" (unknown fields: {UNKNOWN_FIELDS[route]})" if route in UNKNOWN_FIELDS else "")
        )
        parts.append("")
        parts.append("| field | from | here |")
        parts.append("|---|---|---|")
        parts.extend(f"| `{r.name}` | {r.source} | {r.handling}: {_cell(r)} |" for r in rows)
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"


if __name__ == "__main__":  # prints the tables to paste between docs/api.md's markers
    print(docs_block(), end="")
