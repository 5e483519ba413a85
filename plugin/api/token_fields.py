"""A sequence's token outputs as JSON: ids, log-probs and sampling masks, in the shapes each
dialect's clients read.

Masks go out as SGLang's and FastDeploy's per-token id lists (the shape of
`client.converters.to_sglang`), or
compact (`sampling_mask_format: "compact"`) as prime-rl ships them: the flat ids and per-token
counts of `client.converters.to_prime_rl`, base64 of little-endian int32 (float32 for log-probs).
Log-probs are finite in JSON: a log-prob that underflowed to -inf is sent as LOGPROB_FLOOR, as
vLLM does.
"""

from __future__ import annotations

import base64

import numpy as np

from ..client import SampleResult
from ..client.converters import to_prime_rl

LOGPROB_FLOOR = -9999.0
_INF = float("inf")
MASK_FORMATS = ("lists", "compact")


def finite(values: np.ndarray) -> list[float]:
    """Log-probs as JSON numbers (-inf and NaN as LOGPROB_FLOOR)."""
    return _finite_list(np.asarray(values).tolist())


def _finite_list(values: list[float]) -> list[float]:
    # Python floats of a float32 array equal its float64 values; NaN fails both comparisons.
    return [v if -_INF < v < _INF else LOGPROB_FLOOR for v in values]


def token_ids(tokens: SampleResult) -> list[int]:
    return tokens.output_ids.astype(np.int64).tolist()


def _b64(array: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype=dtype).tobytes()).decode("ascii")


def mask_fields(tokens: SampleResult, mask_format: str) -> dict:
    """The masks of `tokens` for an OpenAI choice: `sampling_mask` (one id list per token, most
    probable first), `sampling_mask_logprobs` (each id's log-prob renormalised over its mask,
    aligned) and `sampling_logprobs` (the sampled token's, one per token); compact: one object
    `sampling_mask` {"ids", "counts", "logprobs", "sampling_logprobs"} of base64 arrays."""
    if mask_format == "compact":
        flat = to_prime_rl(tokens.sampling_mask, tokens.sampling_mask_len, tokens.sampling_mask_logprobs)
        return {
            "sampling_mask": {
                "ids": _b64(flat["ids"], "<i4"),
                "counts": _b64(flat["counts"], "<i4"),
                "logprobs": _b64(flat["logprobs"], "<f4"),
                "sampling_logprobs": _b64(tokens.sampling_logprobs, "<f4"),
            }
        }
    lists = sglang_mask_fields(tokens)
    return {
        "sampling_mask": lists["output_token_sampling_mask"],
        "sampling_mask_logprobs": lists["output_token_sampling_support_logprobs"],
        "sampling_logprobs": lists["output_token_sampling_logprobs"],
    }


def sglang_mask_fields(tokens: SampleResult) -> dict:
    """SGLang's mask lists of `tokens`, as `client.converters.to_sglang` shapes them
    (`output_token_sampling_mask`, `output_token_sampling_logprobs`,
    `output_token_sampling_support_logprobs`), log-probs made finite. Sliced row by row in plain
    Python: a streamed chunk holds one token, where whole-array numpy calls cost more than the
    few values they convert."""
    lengths = tokens.sampling_mask_len.tolist()
    masks, support = tokens.sampling_mask, tokens.sampling_mask_logprobs
    return {
        "output_token_sampling_mask": [masks[i, :n].tolist() for i, n in enumerate(lengths)],
        "output_token_sampling_logprobs": finite(tokens.sampling_logprobs),
        "output_token_sampling_support_logprobs": [
            _finite_list(support[i, :n].tolist()) for i, n in enumerate(lengths)
        ],
    }


def weight_version_spans(versions: list[str]) -> list[dict]:
    """Each run of tokens one weight version sampled, as SGLang's and vLLM's `weight_versions`:
    `{"version", "start", "end"}` over output-token indexes, `end` exclusive."""
    spans: list[dict] = []
    for position, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = position + 1
        else:
            spans.append({"version": version, "start": position, "end": position + 1})
    return spans


def token_id_text(token_id: int) -> str:
    """A token as vLLM's `return_tokens_as_token_ids` names it."""
    return f"token_id:{token_id}"


def empty_tokens() -> SampleResult:
    """No tokens (what an aborted non-streamed request has to show)."""
    return SampleResult(
        output_ids=np.zeros(0, np.int32),
        output_logprobs=np.zeros(0, np.float32),
        sampling_mask=np.zeros((0, 0), np.int32),
        sampling_mask_len=np.zeros(0, np.int32),
        sampling_logprobs=np.zeros(0, np.float32),
        sampling_mask_logprobs=np.zeros((0, 0), np.float32),
    )
