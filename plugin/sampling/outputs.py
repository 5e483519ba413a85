"""The output contract: every output the models send, in one table.

Each entry names an output once: the same name on the wire, in `config.pbtxt`, in the sampler's
result, in a generation chunk and in the client's result. Its dtype is the wire dtype, and its
`per` says what one value covers, which fixes its dims in each model:

| per       | sampler dims (per row) | generate dims (per request) |
|-----------|------------------------|-----------------------------|
| "token"   | [ 1 ]                  | [ -1 ]     (one per token)  |
| "mask"    | [ W ]                  | [ -1, W ]                   |
| "request" | (not an output)        | [ 1 ]                       |

`fill` is the value of a row that did not ask for a mask (and the padding of a mask row). JSON
(RFC 8259) has no -Infinity, and parsers outside Python reject a document carrying it: a `-inf`
fill travels as `WIRE_NEG_INF`, float32's lowest finite value, which `to_wire_values` writes and
`from_wire_values` (the clients) turns back into -inf. No log-prob comes near it, and the mask
length says which columns are valid either way.
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
    "each mask id's log-prob renormalised over the support, aligned with sampling_mask, padded with "
    "float32's lowest value (-3.4028235e38; JSON has no -inf)",
)
FINISH_REASON = OutputSpec("finish_reason", np.object_, REQUEST, "", '"length" or "stop" (generate only)')
# A sampling receipt: the seed of the row's noise, the request's `seed` or the one the server drew
# for an unseeded row. A `sampler` row's noise is keyed by it as it is; token i of a `generate`
# request (counting from its first) by `rng.step_seeds(seed, i)`. With the parameters the client
# sent, it re-derives every token from the logits (`client.receipts`).
SAMPLING_SEED = OutputSpec(
    "sampling_seed",
    np.uint64,
    TOKEN,
    0,
    "the seed of the row's noise: the request's seed, or the one the server drew (a sampling receipt)",
)
# generate only: which weights sampled each token (a string the trainer sets with each update).
WEIGHT_VERSION = OutputSpec(
    "weight_version", np.object_, TOKEN, b"", "the weight version that sampled each token (generate only)"
)
# generate only, on a request's last response: its timings in seconds, from the engine's clock.
QUEUE_TIME = OutputSpec("queue_time_s", np.float32, REQUEST, 0.0, "seconds from submission to admission (generate)")
TIME_TO_FIRST_TOKEN = OutputSpec(
    "time_to_first_token_s", np.float32, REQUEST, 0.0, "seconds from submission to the first token (generate)"
)
GENERATION_TIME = OutputSpec(
    "generation_time_s", np.float32, REQUEST, 0.0, "seconds from admission to the last token (generate)"
)
TIMING_OUTPUTS = (QUEUE_TIME, TIME_TO_FIRST_TOKEN, GENERATION_TIME)
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
# What both models send for every sampled token: the sampler's outputs and the seed its noise used.
SAMPLED_OUTPUTS = (*TOKEN_OUTPUTS, SAMPLING_SEED)
SAMPLED_OUTPUT_NAMES = tuple(spec.name for spec in SAMPLED_OUTPUTS)
# What the generate model sends for every generated token: those and the weight version.
GENERATION_TOKEN_OUTPUTS = (*SAMPLED_OUTPUTS, WEIGHT_VERSION)
GENERATION_TOKEN_OUTPUT_NAMES = tuple(spec.name for spec in GENERATION_TOKEN_OUTPUTS)
# Kept for a generated token whose request did not ask for a mask (its mask columns are padding).
UNMASKED_OUTPUT_NAMES = tuple(spec.name for spec in GENERATION_TOKEN_OUTPUTS if spec.per != MASK)
# generate's per-token outputs whose value a request's tokens share (its seed always, its weight
# version until an update lands mid-request). Each would cost a tensor per streamed token, and a
# text one a Python loop over its values in the stub, so the generate model sends them compactly
# (`compact_shared`): a response carries one value per token, or one value standing for all of its
# tokens, or none when its tokens have the value the request's previous response ended with. A
# client restores one per token (`expand_shared`).
SHARED_TOKEN_OUTPUTS = (SAMPLING_SEED, WEIGHT_VERSION)
SHARED_TOKEN_OUTPUT_NAMES = frozenset(spec.name for spec in SHARED_TOKEN_OUTPUTS)
# Every output of each model.
MODEL_OUTPUTS = {
    "sampler": SAMPLED_OUTPUTS,
    "generate": (*GENERATION_TOKEN_OUTPUTS, FINISH_REASON, CONTROL_RESULT, *TIMING_OUTPUTS),
}
BY_NAME = {spec.name: spec for spec in (*GENERATION_TOKEN_OUTPUTS, FINISH_REASON, CONTROL_RESULT, *TIMING_OUTPUTS)}


def to_wire(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The token outputs of `arrays` (keyed by output name, any numeric dtype) in their wire dtypes,
    in wire order; other keys (the sampler's internal `row_max`) are left out."""
    return {spec.name: np.asarray(arrays[spec.name]).astype(spec.dtype, copy=False) for spec in TOKEN_OUTPUTS}


WIRE_NEG_INF = float(np.finfo(np.float32).min)
# The outputs whose -inf fill travels as WIRE_NEG_INF.
NEG_INF_FILLED = frozenset(spec.name for spec in TOKEN_OUTPUTS if spec.fill == -np.inf)


def to_wire_values(name: str, array: np.ndarray) -> np.ndarray:
    """Output `name` as it is sent: -inf (padding) as WIRE_NEG_INF, so every answer is strict JSON."""
    if name not in NEG_INF_FILLED:
        return array
    return np.where(np.isneginf(array), np.float32(WIRE_NEG_INF), array).astype(array.dtype, copy=False)


def from_wire_values(name: str, array: np.ndarray | None) -> np.ndarray | None:
    """Output `name` as a client hands it to its user: WIRE_NEG_INF padding back to -inf."""
    if array is None or name not in NEG_INF_FILLED:
        return array
    array = np.array(array)  # own, writable copy (tritonclient may hand read-only views)
    array[array <= WIRE_NEG_INF] = -np.inf
    return array


def padding(name: str, rows: int, mask_width: int) -> np.ndarray:
    """`rows` values of output `name` for tokens that did not ask for a mask, in its wire dtype."""
    spec = BY_NAME[name]
    shape = (rows, mask_width) if spec.per == MASK else (rows,)
    return np.full(shape, spec.fill, spec.dtype)


def compact_shared(values: np.ndarray, held) -> tuple[np.ndarray | None, object]:
    """What to send of a shared output's per-token `values` ([n]) when the receiver holds `held`
    (the value the request's previous response ended with, None before its first), and the value
    it holds after: None (nothing to send) when every token has `held`, one value when they all
    share one, else every token's."""
    if not len(values):
        return values, held
    first = values[0]
    if len(values) > 1 and not (values == first).all():
        return values, values[-1]
    if held is not None and first == held:
        return None, held
    return values[:1], first


def expand_shared(value: np.ndarray | None, tokens: int, held: np.ndarray | None) -> tuple[np.ndarray | None, object]:
    """A shared output's values for a response's `tokens` tokens, one per token (None when none
    was ever sent), from what the response carried (`value`: None when left out) and what the
    request's previous responses left (`held`: their last value, as a 1-value array); and what is
    held after it."""
    if value is None:
        value = held
    if value is None or len(value) == tokens:
        return value, held if value is None or not len(value) else value[-1:]
    return np.repeat(value[-1:], tokens), value[-1:]
