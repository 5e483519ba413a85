"""vLLM's token route, `POST /inference/v1/generate`: token ids in, token ids out, as vLLM's
`GenerateRequest` / `GenerateTokensResponse` (`output_mode: "tokens"`) shape them. verifiers'
`TrainClient` (through `renderers.client.generate`, prime-rl's rollouts), skyrl and TRL call it.

Masks come as vLLM's `--return-sampling-mask` returns them: `choices[].sampling_mask`, one id list
per token. This server behaves as a vLLM started with that flag, with one difference: a request
whose support is unbounded (no finite top_k, temperature above 0) is served without masks
(`sampling_mask: null`) instead of refused, so no request field is needed: a finite top_k (at
most the mask width W) or greedy sampling returns masks.

`logprobs` (null: none) gives `logprobs.content`, one entry per token with the sampled token's
log-prob under the temperature-scaled distribution, its id both as vLLM's `token_id` and as the
`token: "token_id:N"` that verifiers' renderer client checks, and `top_logprobs`: the sampled
token first, then up to `logprobs` of the support's most probable ids when masks are computed
(their full-distribution log-probs follow exactly from the renormalised ones: the support's
log-mass is the sampled token's `output_logprobs - sampling_logprobs`); alternatives outside the
support are not computed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from pydantic import ValidationError

from ..sampling.params import PARAM_SPECS, RETURN_SAMPLING_MASK, TOP_K_ALL
from .errors import from_validation_error
from .field_table import TOKENS_SAMPLING, accept
from .in_flight import Registration
from .openai_routes import vllm_top_k
from .schemas import TokenGenerateRequest, TokenSamplingParams
from .sequences import FINISH_ABORT, Delta, SequenceRequest, SequenceResult, check_min_tokens
from .service import ApiService, sampling_knobs
from .token_fields import empty_tokens, finite, token_id_text, token_ids, weight_version_spans

# The server's rules name the generate model's fields; this route's clients know these.
TOKEN_NAMES = {
    spec.name: f"sampling_params.{spec.name}" for spec in PARAM_SPECS if spec is not RETURN_SAMPLING_MASK
} | {
    "max_new_tokens": "sampling_params.max_tokens",
    "input_ids": "token_ids",
    "return_sampling_mask": "sampling_params.top_k",
}


@dataclass
class TokenJob:
    """One request's sequences (its n choices) and what its answer needs."""

    request: TokenGenerateRequest
    params: TokenSamplingParams
    request_id: str
    sequences: list[SequenceRequest]
    masks: bool


def _bounded(params: TokenSamplingParams, top_k: int | None) -> bool:
    """Whether the support is bounded, so that masks can be returned (greedy, or a finite top_k)."""
    return params.temperature == 0 or (top_k is not None and top_k != TOP_K_ALL)


def _content(tokens, top: int | None) -> dict:
    """vLLM's `logprobs.content` for `tokens`, `top` alternatives at most (see the module)."""
    ids, values = token_ids(tokens), finite(tokens.output_logprobs)
    masks = tokens.sampling_mask_len is not None and tokens.sampling_mask_logprobs is not None
    entries = []
    for row, (token_id, value) in enumerate(zip(ids, values)):
        entry = {"token_id": token_id, "token": token_id_text(token_id), "logprob": value, "rank": None, "bytes": None}
        top_entries = [{"token_id": token_id, "token": token_id_text(token_id), "logprob": value, "rank": None}]
        if masks and int(tokens.sampling_mask_len[row]):
            support = tokens.sampling_mask[row, : int(tokens.sampling_mask_len[row])].tolist()
            support_logprobs = tokens.sampling_mask_logprobs[row, : len(support)]
            log_mass = float(tokens.output_logprobs[row]) - float(tokens.sampling_logprobs[row])
            rank = support.index(token_id) + 1 if token_id in support else None
            entry["rank"] = top_entries[0]["rank"] = rank
            for position, other in enumerate(support[: top or 0]):
                if other != token_id:
                    full = finite([float(support_logprobs[position]) + log_mass])[0]
                    top_entries.append(
                        {"token_id": other, "token": token_id_text(other), "logprob": full, "rank": position + 1}
                    )
        entry["top_logprobs"] = top_entries
        entries.append(entry)
    return {"content": entries}


class TokenHandler:
    """POST /inference/v1/generate over one ApiService."""

    def __init__(self, service: ApiService):
        self.service = service

    def job(self, request: TokenGenerateRequest) -> TokenJob:
        service = self.service
        service.check_model(request.model)
        try:
            params = TokenSamplingParams.model_validate(
                accept(TOKENS_SAMPLING, request.sampling_params, "sampling_params.")
            )
        except ValidationError as error:
            raise from_validation_error(error, "sampling_params") from None
        service.check_choices(params.n, "sampling_params.n")
        stop_ids = tuple(params.stop_token_ids or ())
        check_min_tokens(params.min_tokens, params.ignore_eos, stop_ids, "sampling_params.min_tokens")
        top_k = vllm_top_k(params.top_k)
        masks = _bounded(params, top_k) if params.return_sampling_mask is None else params.return_sampling_mask
        knobs = sampling_knobs(params, top_k=top_k, return_sampling_mask=masks)
        rows = service.sampling_params(knobs, params.n, TOKEN_NAMES)
        budget = service.budget(
            len(request.token_ids), params.max_tokens, None, ("token_ids", "sampling_params.max_tokens")
        )
        stops = service.stop_strings(params.stop, "sampling_params.stop")
        sequences = [
            SequenceRequest(
                tuple(request.token_ids),
                row,
                budget,
                stop_ids,
                params.ignore_eos,
                stops,
                params.skip_special_tokens,
                False,
                params.include_stop_str_in_output,
                params.min_tokens,
                params.spaces_between_special_tokens,
            )
            for row in rows
        ]
        return TokenJob(request, params, request.request_id or uuid.uuid4().hex, sequences, masks)

    def _choice(self, job: TokenJob, index: int, tokens, finish, stop_reason, versions, final: bool) -> dict:
        top = job.params.logprobs
        return {
            "index": index,
            "logprobs": None if top is None else _content(tokens, top),
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "token_ids": token_ids(tokens),
            "routed_experts": None,
            "sampling_mask": [row.tolist() for row in tokens.masks()] if job.masks else None,
            "weight_versions": weight_version_spans(versions) if final else None,
        }

    def body(self, job: TokenJob, results: list[SequenceResult] | None, aborted: bool = False) -> dict:
        """The non-streamed answer (an aborted request's choices have no tokens: they are not kept)."""
        if results is None:
            choices = [
                self._choice(job, i, empty_tokens(), FINISH_ABORT, None, [], True) for i in range(len(job.sequences))
            ]
            completion = 0
        else:
            choices = [
                self._choice(job, r.index, r.tokens, r.finish_reason, r.stop_reason, r.weight_versions, True)
                for r in results
            ]
            completion = sum(len(r.tokens.output_ids) for r in results)
        prompt = len(job.request.token_ids)
        return {
            "request_id": job.request_id,
            "model": self.service.config.served_model_name,
            "created": int(time.time()),
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "prompt_logprobs": None,
            "prompt_token_ids": list(job.request.token_ids) if job.request.return_token_ids else None,
            "output_mode": "tokens",
            "choices": choices,
        }

    def stream(self, job: TokenJob, registration: Registration) -> TokenStream:
        return TokenStream(self, job, registration)


class TokenStream:
    """The SSE chunks of a streamed token request: one per generated token, as vLLM's
    `GenerateTokensStreamResponse`; weight_versions on each choice's last chunk."""

    def __init__(self, handler: TokenHandler, job: TokenJob, registration: Registration):
        self.handler, self.job, self.registration = handler, job, registration
        self.versions: list[list[str]] = [[] for _ in job.sequences]
        self.counts = [0] * len(job.sequences)
        self.finished = [False] * len(job.sequences)
        self.prompt_sent = not job.request.return_token_ids
        options = job.request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = bool(options and options.continuous_usage_stats)

    def _usage(self, completion: int) -> dict:
        prompt = len(self.job.request.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunk(self, delta: Delta) -> dict:
        index = delta.index
        self.versions[index] += delta.weight_versions
        self.counts[index] += len(delta.tokens.output_ids)
        final = delta.finish_reason is not None
        self.finished[index] = final
        choice = self.handler._choice(
            self.job, index, delta.tokens, delta.finish_reason, delta.stop_reason, self.versions[index], final
        )
        chunk = {"request_id": self.job.request_id, "output_mode": "tokens", "choices": [choice]}
        if not self.prompt_sent:
            chunk["prompt_token_ids"] = list(self.job.request.token_ids)
            self.prompt_sent = True
        if self.continuous_usage:
            chunk["usage"] = self._usage(self.counts[index])
        return chunk

    def closing(self) -> list[dict]:
        chunks = []
        if self.registration.aborted:  # vLLM ends an aborted choice with finish_reason "abort"
            for index, finished in enumerate(self.finished):
                if not finished:
                    choice = self.handler._choice(
                        self.job, index, empty_tokens(), FINISH_ABORT, None, self.versions[index], True
                    )
                    chunks.append({"request_id": self.job.request_id, "output_mode": "tokens", "choices": [choice]})
        if self.include_usage:
            chunks.append(
                {
                    "request_id": self.job.request_id,
                    "output_mode": "tokens",
                    "choices": [],
                    "usage": self._usage(sum(self.counts)),
                }
            )
        return chunks
