"""OpenAI's dialect: GET /v1/models, POST /v1/completions and POST /v1/chat/completions, with
vLLM's and SGLang's extensions for RL (token ids, sampling masks; docs/api.md).

A request becomes one `SequenceRequest` per choice (prompt i's choice j is choice i * n + j, as
OpenAI orders them); streamed answers are Server-Sent Events, one per generated token and
choice, ending with `data: [DONE]`.
"""

from __future__ import annotations

import time
import uuid

from ..sampling.params import TOP_K_ALL
from .errors import ApiError, bad_request
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from .sequences import Delta, SequenceRequest, SequenceResult, check_min_tokens
from .service import ApiService, sampling_knobs
from .sglang_routes import meta_info
from .text import ChatTemplateError, render_chat
from .timings import openai_timings
from .token_fields import finite, mask_fields, token_id_text, token_ids, weight_version_spans

# Completions' default budget when max_tokens is absent, as OpenAI's; chat's is the context's room.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# The server's sampling rules name the generate model's fields; OpenAI's clients know these.
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "input_ids": "prompt"}


def vllm_top_k(top_k: int | None) -> int | None:
    """vLLM's top_k as the sampler reads it: 0 (vLLM's default) and -1 both mean off."""
    return TOP_K_ALL if top_k == 0 else top_k


def _prompts(prompt, service: ApiService, special: bool) -> list[list[int]]:
    """The token ids of `prompt`: a string, strings, token ids, or lists of token ids."""
    message = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(prompt, str):
        return [service.encode(prompt, special)]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(message if prompt is None or not isinstance(prompt, list) else "prompt is empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [service.encode(p, special) for p in prompt]
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise bad_request(message, "prompt")


def _sequences(
    service: ApiService, request: SamplingFields, prompts: list[list[int]], default_budget: int | None, fields
) -> list[SequenceRequest]:
    service.check_model(request.model)
    service.check_choices(len(prompts) * request.n, "n")
    for i, ids in enumerate(prompts):
        if not ids:
            raise bad_request(f"prompt {i} is empty: it must hold at least one token", fields[0])
    stops = service.stop_strings(request.stop, "stop")
    stop_ids = tuple(request.stop_token_ids or ())
    check_min_tokens(request.min_tokens, request.ignore_eos, stop_ids, "min_tokens")
    knobs = sampling_knobs(request, top_k=vllm_top_k(request.top_k))
    params = service.sampling_params(knobs, request.n, OPENAI_NAMES)
    keep_stop = request.include_stop_str_in_output or getattr(request, "no_stop_trim", False)
    max_tokens = getattr(request, "max_completion_tokens", None)
    max_tokens = request.max_tokens if request.max_tokens is not None else max_tokens
    return [
        SequenceRequest(
            tuple(ids),
            params[j],
            service.budget(len(ids), max_tokens, default_budget, fields),
            stop_ids,
            request.ignore_eos,
            stops,
            request.skip_special_tokens is not False,
            request.return_timings,
            keep_stop,
            request.min_tokens,
            request.spaces_between_special_tokens,
        )
        for ids in prompts
        for j in range(request.n)
    ]


def _usage(results_or_counts, prompts: list[list[int]]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = (
        results_or_counts
        if isinstance(results_or_counts, int)
        else sum(len(r.tokens.output_ids) for r in results_or_counts)
    )
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _extensions(request, tokens, prompt_ids, first: bool) -> dict:
    """The extension fields of a choice (or of a streamed choice's chunk)."""
    fields = {}
    if request.return_token_ids:
        if first:
            fields["prompt_token_ids"] = list(prompt_ids)
        fields["token_ids"] = token_ids(tokens)
    if request.return_sampling_mask:
        fields.update(mask_fields(tokens, request.sampling_mask_format))
    return fields


def _log_prob_tokens(tokens, token_texts: list[str], as_ids: bool) -> list[str]:
    """Each token as the log-probs name it: its text, or `token_id:N` (return_tokens_as_token_ids)."""
    return [token_id_text(i) for i in token_ids(tokens)] if as_ids else token_texts


def _completion_logprobs(tokens, token_texts: list[str], offset: int, as_ids: bool) -> dict:
    """OpenAI's completion log-probs; with `logprobs: 0` vLLM's top_logprobs hold the sampled
    token alone at each position (its logprobs + 1 convention)."""
    offsets, at = [], offset
    for piece in token_texts:
        offsets.append(at)
        at += len(piece)
    values = finite(tokens.output_logprobs)
    names = _log_prob_tokens(tokens, token_texts, as_ids)
    return {
        "tokens": names,
        "token_logprobs": values,
        "top_logprobs": [{name: value} for name, value in zip(names, values)],
        "text_offset": offsets,
    }


def _chat_logprobs(tokens, token_texts: list[str], as_ids: bool) -> dict:
    values = finite(tokens.output_logprobs)
    names = _log_prob_tokens(tokens, token_texts, as_ids)
    return {
        "content": [
            {"token": name, "logprob": value, "bytes": list(name.encode()), "top_logprobs": []}
            for name, value in zip(names, values)
        ]
    }


def _check_logprobs(request) -> None:
    many = request.logprobs if isinstance(request, CompletionRequest) else request.top_logprobs
    if many:
        field = "logprobs" if isinstance(request, CompletionRequest) else "top_logprobs"
        raise bad_request(
            f"{field} must be 0: the generate model returns the sampled token's log-probability only (no top "
            "alternatives); return_sampling_mask gives every support token's log-prob",
            field,
        )


def _check_completion_fields(request: CompletionRequest) -> None:
    if request.best_of not in (None, request.n):
        raise bad_request("best_of is not supported (it must equal n)", "best_of")
    _check_logprobs(request)


def _check_chat_fields(request: ChatCompletionRequest) -> None:
    if request.continue_final_message and request.add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true (set add_generation_prompt false)",
            "continue_final_message",
        )
    _check_logprobs(request)


def _chat_prompt(service: ApiService, request: ChatCompletionRequest) -> list[int]:
    messages = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request("only text content parts are supported", f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        entry = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        messages.append(entry)
    kwargs = dict(request.chat_template_kwargs or {})
    if request.continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        return render_chat(
            service.tokenizer, messages, request.add_generation_prompt, kwargs, request.add_special_tokens
        )
    except ChatTemplateError as error:
        raise bad_request(str(error), "messages") from None


class OpenAIHandlers:
    """The three routes over one ApiService."""

    def __init__(self, service: ApiService):
        self.service = service

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.service.config.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "triton-sampling-mask",
                    "max_model_len": self.service.context_length,
                }
            ],
        }

    def completion_sequences(self, request: CompletionRequest) -> tuple[list[list[int]], list[SequenceRequest]]:
        _check_completion_fields(request)
        prompts = _prompts(request.prompt, self.service, request.add_special_tokens)
        sequences = _sequences(self.service, request, prompts, COMPLETIONS_DEFAULT_MAX_TOKENS, ("prompt", "max_tokens"))
        return prompts, sequences

    def chat_sequences(self, request: ChatCompletionRequest) -> tuple[list[list[int]], list[SequenceRequest]]:
        _check_chat_fields(request)
        prompt = _chat_prompt(self.service, request)
        field = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
        return [prompt], _sequences(self.service, request, [prompt], None, ("messages", field))

    def completion_body(self, request: CompletionRequest, prompts, results: list[SequenceResult]) -> dict:
        choices = []
        for result in results:
            choice = {
                "index": result.index,
                "text": result.text,
                "logprobs": _completion_logprobs(
                    result.tokens, result.token_texts, 0, bool(request.return_tokens_as_token_ids)
                )
                if request.logprobs is not None
                else None,
                "finish_reason": result.finish_reason,
                "stop_reason": result.stop_reason,
            }
            choice.update(_extensions(request, result.tokens, result.prompt_ids, True))
            if request.return_weight_versions:
                choice["weight_versions"] = weight_version_spans(result.weight_versions)
            if request.return_timings:
                choice["timings"] = openai_timings(result.timings, len(result.tokens.output_ids))
            choices.append(choice)
        return {
            "id": f"cmpl-{request.request_id or uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.service.config.served_model_name,
            "choices": choices,
            "usage": _usage(results, prompts),
        }

    def chat_body(self, request: ChatCompletionRequest, prompts, results: list[SequenceResult]) -> dict:
        choices = []
        for result in results:
            choice = {
                "index": result.index,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": _chat_logprobs(result.tokens, result.token_texts, bool(request.return_tokens_as_token_ids))
                if request.logprobs
                else None,
                "finish_reason": result.finish_reason,
                "stop_reason": result.stop_reason,
            }
            choice.update(_extensions(request, result.tokens, result.prompt_ids, False))
            if request.return_weight_versions:
                choice["weight_versions"] = weight_version_spans(result.weight_versions)
            if request.return_timings:
                choice["timings"] = openai_timings(result.timings, len(result.tokens.output_ids))
            if request.return_meta_info:
                choice["meta_info"] = _meta_info(request, result)
                choice["response_token_ids"] = token_ids(result.tokens)
            choices.append(choice)
        body = {
            "id": f"chatcmpl-{request.request_id or uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.service.config.served_model_name,
            "choices": choices,
            "usage": _usage(results, prompts),
        }
        if request.return_token_ids:
            body["prompt_token_ids"] = list(prompts[0])
        return body


def _meta_info(request: ChatCompletionRequest, result: SequenceResult) -> dict:
    """SGLang's meta_info for a chat choice (SGLang's clients read the masks there)."""
    return meta_info(result, "", request.return_sampling_mask, request.sampling_logprobs_mode, False)


class CompletionStream:
    """The SSE chunks of a streamed completion (or chat completion) from its deltas."""

    def __init__(self, handlers: OpenAIHandlers, request, prompts: list[list[int]], sequences: list[SequenceRequest]):
        self.request, self.prompts, self.sequences = request, prompts, sequences
        self.chat = isinstance(request, ChatCompletionRequest)
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.base = {
            "id": f"{prefix}-{request.request_id or uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": handlers.service.config.served_model_name,
        }
        self.started = [False] * len(sequences)
        self.offsets = [0] * len(sequences)
        self.completion_tokens = 0
        self.choice_tokens = [0] * len(sequences)
        self.versions: list[list[str]] = [[] for _ in sequences]
        options = request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = bool(options and options.continuous_usage_stats)

    def opening(self) -> list[dict]:
        """Chat streams open each choice with the assistant role, as OpenAI's do."""
        if not self.chat:
            return []
        chunk = {
            **self.base,
            "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(self.sequences))
            ],
        }
        if self.request.return_token_ids:
            chunk["prompt_token_ids"] = list(self.prompts[0])
        return [chunk]

    def chunk(self, delta: Delta) -> dict:
        request, index = self.request, delta.index
        first = not self.started[index]
        self.started[index] = True
        self.completion_tokens += len(delta.tokens.output_ids)
        self.choice_tokens[index] += len(delta.tokens.output_ids)
        if self.chat:
            choice = {
                "index": index,
                "delta": {"content": delta.text} if delta.text else {},
                "logprobs": _chat_logprobs(delta.tokens, delta.token_texts, bool(request.return_tokens_as_token_ids))
                if request.logprobs
                else None,
            }
        else:
            choice = {
                "index": index,
                "text": delta.text,
                "logprobs": _completion_logprobs(
                    delta.tokens, delta.token_texts, self.offsets[index], bool(request.return_tokens_as_token_ids)
                )
                if request.logprobs is not None
                else None,
            }
        self.offsets[index] += sum(len(t) for t in delta.token_texts)
        choice["finish_reason"] = delta.finish_reason
        choice["stop_reason"] = delta.stop_reason
        choice.update(_extensions(request, delta.tokens, self.sequences[index].prompt_ids, first and not self.chat))
        self.versions[index] += delta.weight_versions
        if request.return_weight_versions and delta.finish_reason:  # vLLM: on each choice's last chunk
            choice["weight_versions"] = weight_version_spans(self.versions[index])
        if request.return_timings and delta.finish_reason:
            choice["timings"] = openai_timings(delta.timings, self.choice_tokens[index])
        chunk = {**self.base, "choices": [choice]}
        if self.continuous_usage:
            chunk["usage"] = _usage(self.completion_tokens, self.prompts)
        return chunk

    def closing(self) -> list[dict]:
        if not self.include_usage:
            return []
        return [{**self.base, "choices": [], "usage": _usage(self.completion_tokens, self.prompts)}]


__all__ = ["ApiError", "CompletionStream", "OpenAIHandlers"]
