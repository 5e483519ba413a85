"""The input contract: every input both models take, in one table (the outputs are in `outputs`).

Each entry names an input once: the same name on the wire, in `config.pbtxt`, in the server's
parsing and in both clients. Its dtype is the wire dtype, and its `per` fixes its dims:

| per      | dims   | what it holds                                                     |
|----------|--------|-------------------------------------------------------------------|
| "row"    | [ 1 ]  | one value per row (sampler) or per request (generate)             |
| "vector" | [ -1 ] | the sampler's logits row                                          |
| "list"   | [ -1 ] | a list of any length per request (ragged: batched side by side)   |

Every scalar sampling parameter (`params.PARAM_SPECS`) is a "row" input of both models, optional,
with the same name, dtype and default. `optional` is what config.pbtxt says; `required` inputs
are refused by the generate model when a generation request leaves them out (the config must
mark them optional, since a control request carries only `control`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .params import LOGITS, PARAM_SPECS

ROW = "row"
VECTOR = "vector"
LIST = "list"

# Triton's wire datatype of each numpy dtype the models take (tritonclient's np_to_triton_dtype,
# which this layer may not import).
_DATATYPES = {
    np.dtype(np.float32): "FP32",
    np.dtype(np.float16): "FP16",
    np.dtype(np.int32): "INT32",
    np.dtype(np.uint64): "UINT64",
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.object_): "BYTES",
}


def triton_datatype(dtype) -> str:
    """Triton's wire datatype ("FP32", "BYTES", ...) of a numpy dtype."""
    return _DATATYPES[np.dtype(dtype)]


def config_data_type(dtype) -> str:
    """The config.pbtxt `data_type` of a numpy dtype ("TYPE_FP32"; BYTES is TYPE_STRING there)."""
    datatype = triton_datatype(dtype)
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


@dataclass(frozen=True)
class InputSpec:
    """One input: its name everywhere, wire dtype, shape class, whether config.pbtxt marks it
    optional, whether a generation request must carry it, and its meaning."""

    name: str
    dtype: type
    per: str  # ROW, VECTOR or LIST
    optional: bool
    doc: str
    required: bool = False

    @property
    def datatype(self) -> str:
        """Triton's wire datatype ("INT32", "BYTES", ...)."""
        return triton_datatype(self.dtype)

    @property
    def dims(self) -> list[int]:
        """Its dims in config.pbtxt (without the batch dimension)."""
        return [1] if self.per == ROW else [-1]

    @property
    def ragged(self) -> bool:
        """Whether config.pbtxt lets requests of different lengths batch together (allow_ragged_batch)."""
        return self.per == LIST


# The logits' wire dtype by default; a deployment may declare TYPE_BF16 or TYPE_FP16 instead
# (model_config.LOGITS_DATA_TYPES).
LOGITS_INPUT = InputSpec(LOGITS, np.float32, VECTOR, False, "logits [rows, V]")
PARAM_INPUTS = tuple(
    InputSpec(spec.name, spec.dtype, ROW, True, f"sampling parameter (default {spec.default})") for spec in PARAM_SPECS
)
INPUT_IDS = InputSpec("input_ids", np.int32, LIST, True, "the prompt's token ids", required=True)
MAX_NEW_TOKENS = InputSpec("max_new_tokens", np.int32, ROW, True, "tokens to generate at most", required=True)
STOP_TOKEN_IDS = InputSpec("stop_token_ids", np.int32, LIST, True, "ids that end the generation (kept)")
IGNORE_EOS = InputSpec("ignore_eos", np.bool_, ROW, True, "generate past the LM's end-of-sequence ids")
STREAM = InputSpec("stream", np.bool_, ROW, True, "responses as tokens come, not one at the end")
# Makes a request a control request (weight updates, pause / continue), answered in control_result.
CONTROL = InputSpec("control", np.object_, ROW, True, "a control request, JSON (docs/weights.md)")
CONTROL_INPUT = CONTROL.name

SAMPLER_INPUTS = (LOGITS_INPUT, *PARAM_INPUTS)
GENERATE_INPUTS = (INPUT_IDS, MAX_NEW_TOKENS, STOP_TOKEN_IDS, IGNORE_EOS, STREAM, *PARAM_INPUTS, CONTROL)
# Every input of each model, in config.pbtxt order.
MODEL_INPUTS = {"sampler": SAMPLER_INPUTS, "generate": GENERATE_INPUTS}
INPUTS_BY_NAME = {spec.name: spec for spec in (*SAMPLER_INPUTS, *GENERATE_INPUTS)}


def generate_wire_inputs(values: dict[str, object]) -> dict[str, tuple[np.ndarray, str]]:
    """One generate request's inputs (name -> value: a list for a "list" input, else a scalar) as
    (array with the batch dimension 1, Triton datatype), in the table's dtypes."""
    wire = {}
    for name, value in values.items():
        spec = INPUTS_BY_NAME[name]
        wire[name] = (np.asarray(value, dtype=spec.dtype).reshape(1, -1), spec.datatype)
    return wire
