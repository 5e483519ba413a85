"""SGLang's native dialect: POST /generate, as SGLang's `GenerateReqInput` and its answers.

`text` or `input_ids`, one prompt or a batch; `sampling_params` one dict for all or one per
prompt (its `n` repeats a prompt). The answer is one object per sequence (a list for a batch):
`text`, `output_ids` and `meta_info` with `id`, `finish_reason` (`{"type": "length", "length": N}`
or `{"type": "stop", "matched": id or string}`), `prompt_tokens`, `completion_tokens`,
`cached_tokens`, `e2e_latency`, `output_token_logprobs` (`[logprob, id, text or null]` per token)
with `return_logprob`, and with `return_sampling_mask` SGLang's `output_token_sampling_mask`,
`output_token_sampling_logprobs` (the sampled token's per token; each support token's, aligned
with the mask, under `sampling_logprobs_mode: "support"`) and `output_token_sampling_mask_length`.
Streamed, every event carries the sequence so far (SGLang's default), then `data: [DONE]`.
"""

from __future__ import annotations

import itertools
import time
import uuid

from pydantic import ValidationError

from ..client import SampleResult, concatenate_tokens
from ..sampling.params import PARAM_SPECS, RETURN_SAMPLING_MASK, TOP_K_ALL
from .errors import bad_request, from_validation_error
from .field_table import GENERATE_SAMPLING, accept
from .in_flight import ABORT_MESSAGE
from .schemas import GenerateRequest, SGLangSamplingParams
from .sequences import FINISH_ABORT, FINISH_LENGTH, SequenceRequest, SequenceResult, check_min_tokens
from .service import ApiService, sampling_knobs
from .timings import sglang_timings
from .token_fields import empty_tokens, finite, sglang_mask_fields, token_ids, weight_version_spans

# SGLang's default budget when max_new_tokens is absent.
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
# SGLang's top_k for "the whole vocabulary" (its default; -1 is normalised to it).
SGLANG_TOP_K_ALL = 1 << 30
# slime's custom parameter asking for every token's top-p kept set (its sampling mask).
TOP_P_TOKEN_IDS = "return_top_p_token_ids"
# Where SGLang carries each field a message may name: the sampling parameters and the budget in
# `sampling_params` (the seed as `sampling_seed`), return_sampling_mask at the top level.
SGLANG_RENAMES = {"seed": "sampling_seed"}
SGLANG_NAMES = {
    spec.name: f"sampling_params.{SGLANG_RENAMES.get(spec.name, spec.name)}"
    for spec in PARAM_SPECS
    if spec is not RETURN_SAMPLING_MASK
} | {"max_new_tokens": "sampling_params.max_new_tokens"}


def _finish_reason(result) -> dict | None:
    if not result.finish_reason:
        return None
    if result.finish_reason == FINISH_ABORT:
        return {"type": "abort", "message": ABORT_MESSAGE}
    if result.finish_reason == FINISH_LENGTH:
        return {"type": "length", "length": len(result.tokens.output_ids)}
    matched = result.stop_reason
    if matched is None and len(result.tokens.output_ids):
        matched = int(result.tokens.output_ids[-1])  # the EOS id that ended it
    return {"type": "stop", "matched": matched}


def meta_info(
    result,
    rid: str,
    masks: bool,
    logprobs_mode: str,
    logprobs: bool,
    texts: bool = False,
    started=None,
    timings: bool = False,
    version_now: str | None = None,
    top_p_token_ids: bool = False,
):
    """SGLang's meta_info of a sequence (whole, or so far while streaming); `timings` adds the
    generate model's timings once the sequence has them (plugin/api/timings.py). `weight_version`
    is the version of the weights that sampled the last token (`version_now` when there is no
    token), `weight_versions` the spans of tokens each version sampled, as SGLang reports them."""
    tokens: SampleResult = result.tokens
    versions = result.weight_versions
    info = {
        "id": rid,
        "finish_reason": _finish_reason(result),
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": len(tokens.output_ids),
        "cached_tokens": 0,
        "weight_version": versions[-1] if versions else version_now,
        "weight_versions": weight_version_spans(versions),
    }
    if started is not None:
        info["e2e_latency"] = time.monotonic() - started
    if timings:
        info.update(sglang_timings(result.timings, len(tokens.output_ids)))
    if logprobs:
        values = finite(tokens.output_logprobs)
        pieces = result.token_texts if texts else [None] * len(values)
        info["input_token_logprobs"] = []
        info["output_token_logprobs"] = [[v, i, t] for v, i, t in zip(values, token_ids(tokens), pieces)]
    if masks:
        lists = sglang_mask_fields(tokens)
        info["output_token_sampling_mask"] = lists["output_token_sampling_mask"]
        info["output_token_sampling_logprobs"] = lists[
            "output_token_sampling_support_logprobs" if logprobs_mode == "support" else "output_token_sampling_logprobs"
        ]
        info["output_token_sampling_mask_length"] = len(tokens.output_ids)
    if top_p_token_ids:
        info.update(_top_p_token_ids(tokens))
    return info


def _top_p_token_ids(tokens: SampleResult) -> dict:
    """slime's top-p replay fields: every token's mask, flat, and where each token's starts
    (`offsets[i]:offsets[i + 1]`, one more offset than tokens), as JSON lists of ints."""
    lengths = tokens.sampling_mask_len.tolist()
    ids = [i for row, n in zip(tokens.sampling_mask.tolist(), lengths) for i in row[:n]]
    return {"top_p_token_ids": ids, "top_p_token_offsets": [0, *itertools.accumulate(lengths)]}


def _prompts(request: GenerateRequest, service: ApiService) -> tuple[list[list[int]], bool, str]:
    """The prompts' ids, whether the request is a batch, and the field they came from."""
    if (request.text is None) == (request.input_ids is None):
        raise bad_request("give either text or input_ids (not both)", "text")
    if request.text is not None:
        text = request.text
        if isinstance(text, str):
            return [service.encode(text)], False, "text"
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [service.encode(t) for t in text], True, "text"
        raise bad_request("text must be a string or a non-empty list of strings", "text")
    ids = request.input_ids

    def is_ids(value) -> bool:
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

    if is_ids(ids) and ids:
        return [list(ids)], False, "input_ids"
    if isinstance(ids, list) and ids and all(is_ids(p) for p in ids):
        return [list(p) for p in ids], True, "input_ids"
    raise bad_request("input_ids must be a list of token ids or a non-empty list of such lists", "input_ids")


def _sampling_params(value, prompts: int) -> list[SGLangSamplingParams]:
    """`sampling_params`: one object for every prompt, or a list with one per prompt."""
    items = value if isinstance(value, list) else [value or {}] * prompts
    parsed = []
    for i, item in enumerate(items):
        where = f"sampling_params[{i}]" if isinstance(value, list) else "sampling_params"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        try:
            parsed.append(SGLangSamplingParams.model_validate(accept(GENERATE_SAMPLING, item, f"{where}.")))
        except ValidationError as error:
            raise from_validation_error(error, where) from None
    return parsed


def _asks_top_p_token_ids(p: SGLangSamplingParams, where: str) -> bool:
    """Whether `custom_params` asks for slime's top-p kept sets, the one custom parameter here."""
    custom = dict(p.custom_params or {})
    asked = custom.pop(TOP_P_TOKEN_IDS, False)
    if custom or not isinstance(asked, bool):
        name = next(iter(custom), TOP_P_TOKEN_IDS)
        raise bad_request(
            f"{where}.custom_params.{name} is not supported: no custom logit processors run here "
            f'(only {{"{TOP_P_TOKEN_IDS}": true}}, slime\'s top-p replay)',
            f"{where}.custom_params",
        )
    return asked


def _check_unsupported(request: GenerateRequest, params: list[SGLangSamplingParams]) -> None:
    if request.logprob_start_len not in (None, -1):
        raise bad_request("logprob_start_len must be -1: prompt log-probs are not computed", "logprob_start_len")
    if request.top_logprobs_num:
        raise bad_request(
            "top_logprobs_num must be 0: the generate model returns the sampled token's log-probability only",
            "top_logprobs_num",
        )
    for p in params:
        check_min_tokens(p.min_new_tokens or 0, bool(p.ignore_eos), p.stop_token_ids, "sampling_params.min_new_tokens")


def _top_k(top_k: int | None) -> int | None:
    """SGLang's top_k as the sampler reads it: -1 and 1 << 30 (SGLang's default) mean off."""
    return TOP_K_ALL if top_k == SGLANG_TOP_K_ALL else top_k


class GenerateHandler:
    """POST /generate over one ApiService."""

    def __init__(self, service: ApiService):
        self.service = service

    def sequences(self, request: GenerateRequest) -> tuple[list[SequenceRequest], bool, list[str]]:
        """The sequences of a request (prompt i's n copies in a row), whether to answer a list,
        and each sequence's id."""
        service = self.service
        prompts, batch, field = _prompts(request, service)
        per_prompt = _sampling_params(request.sampling_params, len(prompts))
        if len(per_prompt) != len(prompts):
            raise bad_request(
                f"sampling_params holds {len(per_prompt)} entries for {len(prompts)} prompts", "sampling_params"
            )
        _check_unsupported(request, per_prompt)
        count = sum(p.n or 1 for p in per_prompt)
        service.check_choices(count, "sampling_params.n")
        sequences = []
        for ids, p in zip(prompts, per_prompt):
            top_p_ids = _asks_top_p_token_ids(p, "sampling_params")
            masks = bool(request.return_sampling_mask) or top_p_ids
            knobs = sampling_knobs(p, SGLANG_RENAMES, return_sampling_mask=masks, top_k=_top_k(p.top_k))
            rows = service.sampling_params(knobs, p.n or 1, SGLANG_NAMES)
            default = min(SGLANG_DEFAULT_MAX_NEW_TOKENS, max(service.context_length - len(ids), 1))
            budget = service.budget(len(ids), p.max_new_tokens, default, (field, "sampling_params.max_new_tokens"))
            stops = service.stop_strings(p.stop, "sampling_params.stop")
            for row in rows:
                sequences.append(
                    SequenceRequest(
                        tuple(ids),
                        row,
                        budget,
                        tuple(p.stop_token_ids or ()),
                        bool(p.ignore_eos),
                        stops,
                        p.skip_special_tokens is not False,
                        request.return_timings,
                        bool(p.no_stop_trim),
                        p.min_new_tokens or 0,
                        p.spaces_between_special_tokens is not False,
                        top_p_ids,
                    )
                )
        rids = _rids(request.rid, len(sequences))
        return sequences, batch or count > 1, rids

    def item(
        self, request: GenerateRequest, result, rid: str, started: float, version_now=None, top_p_ids: bool = False
    ) -> dict:
        item = {
            "text": result.text,
            "output_ids": token_ids(result.tokens),
            "meta_info": meta_info(
                result,
                rid,
                bool(request.return_sampling_mask),
                request.sampling_logprobs_mode or "selected",
                bool(request.return_logprob),
                bool(request.return_text_in_logprobs),
                started,
                request.return_timings,
                version_now,
                top_p_ids,
            ),
        }
        if request.return_prompt_token_ids:
            item["prompt_token_ids"] = list(result.prompt_ids)
        return item

    def aborted(self, request: GenerateRequest, sequences, rids, started: float, batch: bool):
        """The answer of a non-streamed request aborted before it finished: no tokens (they are not
        kept), SGLang's abort finish reason."""
        items = []
        for index, (sequence, rid) in enumerate(zip(sequences, rids)):
            result = SequenceResult(index, empty_tokens(), "", [], FINISH_ABORT, None, sequence.prompt_ids)
            items.append(self.item(request, result, rid, started, top_p_ids=sequence.top_p_token_ids))
        return items if batch else items[0]

    def aborted_events(self, request: GenerateRequest, so_far: list, rids, started: float, batch: bool) -> list:
        """A streamed request's last events after an abort: each unfinished sequence as it stood,
        with SGLang's abort finish reason."""
        events = []
        for index, state in enumerate(so_far):
            if state.finish_reason:
                continue
            state.finish_reason = FINISH_ABORT
            item = self.item(request, state, rids[index], started, top_p_ids=state.top_p_token_ids)
            if batch:
                item["index"] = index
            events.append(item)
        return events


def _rids(rid, count: int) -> list[str]:
    if rid is None:
        base = uuid.uuid4().hex
        return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
    if isinstance(rid, list):
        if len(rid) != count:
            raise bad_request(f"rid holds {len(rid)} ids for {count} sequences", "rid")
        return list(rid)
    return [rid] if count == 1 else [f"{rid}-{i}" for i in range(count)]


class SequenceSoFar:
    """A streamed sequence's state for SGLang's cumulative events."""

    def __init__(self, request: SequenceRequest):
        self.prompt_ids = request.prompt_ids
        self.top_p_token_ids = request.top_p_token_ids
        self.parts: list[SampleResult] = []
        self.tokens = empty_tokens()
        self.text = ""
        self.token_texts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.timings = None
        self.weight_versions: list[str] = []

    def add(self, delta) -> SequenceSoFar:
        self.parts.append(delta.tokens)
        self.weight_versions += delta.weight_versions
        self.text += delta.text
        self.token_texts += delta.token_texts
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.timings = delta.timings
        self.tokens = concatenate_tokens(self.parts)
        self.parts = [self.tokens]
        return self


__all__ = ["GenerateHandler", "SequenceResult", "SequenceSoFar", "meta_info"]
