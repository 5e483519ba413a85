"""The output contract: every output the models send, in one table.

Each entry names an output once: the same name on the wire, in `config.pbtxt`, in the sampler's
result, in a generation chunk and in the client's result. Its dtype is the wire dtype, and its
`per` says what one value covers, which fixes its dims in each model:

| per       | sampler dims (per row) | generate dims (per request) |
|-----------|------------------------|-----------------------------|
| "token"   | [ 1 ]                  | [ -1 ]     (one per token)  |
| "mask"    | [ W ]                  | [ -1, W ]                   |
| "request" | (not an output)        | [ 1 ]                       |

`fill` is the value of a row that did not ask for a mask (and the padding of a mask row).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOKEN = "token"
MASK = "mask"
REQUEST = "request"


@dataclass(frozen=True)
class OutputSpec:
    """One output: its name everywhere, wire dtype, what one value covers, fill value and meaning."""

    name: str
    dtype: type
    per: str  # TOKEN, MASK or REQUEST
    fill: object
    doc: str

    def dims(self, model: str, mask_width: int) -> list[int]:
        """The output's dims in `model`'s config.pbtxt ("sampler" or "generate")."""
        if self.per == REQUEST:
            return [1]
        width = [mask_width] if self.per == MASK else []
        return (width or [1]) if model == "sampler" else [-1, *width]


OUTPUT_IDS = OutputSpec("output_ids", np.int32, TOKEN, 0, "sampled token id")
OUTPUT_LOGPROBS = OutputSpec(
    "output_logprobs",
    np.float32,
    TOKEN,
    0.0,
    "log-prob of the sampled token under softmax(logits / T) over the whole vocabulary",
)
SAMPLING_MASK = OutputSpec("sampling_mask", np.int32, MASK, -1, "ids of the support, most probable first, -1 padded")
SAMPLING_MASK_LEN = OutputSpec("sampling_mask_len", np.int32, TOKEN, 0, "valid ids in sampling_mask (0: not asked)")
SAMPLING_LOGPROBS = OutputSpec(
    "sampling_logprobs", np.float32, TOKEN, 0.0, "log-prob of the sampled token renormalised over the support"
)
SAMPLING_MASK_LOGPROBS = OutputSpec(
    "sampling_mask_logprobs",
    np.float32,
    MASK,
    -np.inf,
    "each mask id's log-prob renormalised over the support, aligned with sampling_mask, -inf padded",
)
FINISH_REASON = OutputSpec("finish_reason", np.object_, REQUEST, "", '"length" or "stop" (generate only)')
# generate only: which weights sampled each token (a string the trainer sets with each update).
WEIGHT_VERSION = OutputSpec(
    "weight_version", np.object_, TOKEN, b"", "the weight version that sampled each token (generate only)"
)
# generate only: a control request's answer (JSON text), sent on control requests alone.
CONTROL_RESULT = OutputSpec("control_result", np.object_, REQUEST, b"", "a control request's answer, JSON (generate)")

# What the sampler returns for every sampled token, in wire order (both models send these).
TOKEN_OUTPUTS = (
    OUTPUT_IDS,
    OUTPUT_LOGPROBS,
    SAMPLING_MASK,
    SAMPLING_MASK_LEN,
    SAMPLING_LOGPROBS,
    SAMPLING_MASK_LOGPROBS,
)
TOKEN_OUTPUT_NAMES = tuple(spec.name for spec in TOKEN_OUTPUTS)
# The [.., W] outputs: a row group may fill only their first columns; the rest keeps `fill`.
MASK_OUTPUT_NAMES = tuple(spec.name for spec in TOKEN_OUTPUTS if spec.per == MASK)
# Kept for a token whose request did not ask for a mask (its mask columns are padding).
UNMASKED_OUTPUT_NAMES = tuple(spec.name for spec in TOKEN_OUTPUTS if spec.per != MASK)
# What the generate model sends for every generated token: the sampler's outputs and the weight version.
GENERATION_TOKEN_OUTPUTS = (*TOKEN_OUTPUTS, WEIGHT_VERSION)
GENERATION_TOKEN_OUTPUT_NAMES = tuple(spec.name for spec in GENERATION_TOKEN_OUTPUTS)
# Every output of each model.
MODEL_OUTPUTS = {"sampler": TOKEN_OUTPUTS, "generate": (*GENERATION_TOKEN_OUTPUTS, FINISH_REASON, CONTROL_RESULT)}
BY_NAME = {spec.name: spec for spec in (*GENERATION_TOKEN_OUTPUTS, FINISH_REASON, CONTROL_RESULT)}


def to_wire(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The token outputs of `arrays` (keyed by output name, any numeric dtype) in their wire dtypes,
    in wire order; other keys (the sampler's internal `row_max`) are left out."""
    return {spec.name: np.asarray(arrays[spec.name]).astype(spec.dtype, copy=False) for spec in TOKEN_OUTPUTS}


def padding(name: str, rows: int, mask_width: int) -> np.ndarray:
    """`rows` values of output `name` for tokens that did not ask for a mask, in its wire dtype."""
    spec = BY_NAME[name]
    shape = (rows, mask_width) if spec.per == MASK else (rows,)
    return np.full(shape, spec.fill, spec.dtype)
