"""Triton request parsing and response building for both models: the sampler's logits and
parameters, generate's prompts and result chunks, and the error and wanted-outputs rules they share.

`pb_utils` (the Python backend's `triton_python_backend_utils`) is passed in, so this package
imports without Triton and the same code serves every model that takes sampler parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..generation.request import GenerationChunk, GenerationRequest, check_generation_request
from ..sampling.inputs import IGNORE_EOS, INPUT_IDS, MAX_NEW_TOKENS, ROW, STOP_TOKEN_IDS, STREAM, InputSpec
from ..sampling.outputs import FINISH_REASON, SHARED_TOKEN_OUTPUT_NAMES, compact_shared, to_wire_values
from ..sampling.params import LOGITS, PARAM_SPECS, RowParams
from ..sampling.validation import SamplingRequestError, check_vocab_size


@dataclass
class ParsedRequest:
    """One request's rows: logits [rows, V] on the sampling device and their parameters."""

    logits: torch.Tensor
    params: RowParams

    @property
    def rows(self) -> int:
        return self.logits.shape[0]


def input_to_torch(tensor, device: torch.device) -> torch.Tensor:
    """A pb_utils.Tensor as a torch tensor on `device`, without a copy where it already is there:
    a host tensor through numpy (a view of the request's shared memory), a GPU-resident one or a
    BF16 one (which `as_numpy` refuses) through DLPack."""
    if tensor.is_cpu():
        try:
            return torch.from_numpy(tensor.as_numpy()).to(device)
        except Exception:  # BF16 has no numpy type: the Python backend refuses it
            pass
    return torch.from_dlpack(tensor.to_dlpack()).to(device)


def input_to_numpy(tensor) -> np.ndarray:
    """A pb_utils.Tensor as numpy; a GPU-resident one (FORCE_CPU_ONLY_INPUT_TENSORS "no") is
    copied to the host through DLPack, since `as_numpy` refuses GPU tensors."""
    if tensor.is_cpu():
        return tensor.as_numpy()
    return torch.from_dlpack(tensor.to_dlpack()).cpu().numpy()


def read_input(request, pb_utils, name: str, dtype, required: bool = False) -> np.ndarray | None:
    """A request input as host numpy of `dtype` (None when absent and optional); the error names it."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        if required:
            raise SamplingRequestError(name, f"missing required input '{name}'")
        return None
    values = input_to_numpy(tensor)
    if values.dtype != np.dtype(dtype):
        raise SamplingRequestError(name, f"{name} must be {np.dtype(dtype).name}, got {values.dtype}")
    return values


def read_params(request, pb_utils, rows: int) -> RowParams:
    """The optional per-row scalars of a request, defaults filled in; shapes checked per field."""
    params = RowParams.defaults(rows)
    for spec in PARAM_SPECS:
        values = read_input(request, pb_utils, spec.name, spec.dtype)
        if values is None:
            continue
        if values.size != rows or values.ndim not in (1, 2):
            raise SamplingRequestError(
                spec.name,
                f"{spec.name} must have shape [{rows}, 1] (one value per logits row), got {list(values.shape)}",
            )
        setattr(params, spec.name, values.reshape(rows))
        if spec.presence:
            setattr(params, spec.presence, np.ones(rows, np.bool_))
    return params


def parse_request(
    request, pb_utils, device: torch.device, max_vocab_size: int, logits_dtype: torch.dtype = torch.float32
) -> ParsedRequest:
    """Logits and parameters of one request; raises SamplingRequestError naming a bad field."""
    tensor = pb_utils.get_input_tensor_by_name(request, LOGITS)
    if tensor is None:
        raise SamplingRequestError(LOGITS, "missing required input 'logits'")
    shape = list(tensor.shape())
    if len(shape) != 2:
        raise SamplingRequestError(LOGITS, f"logits must have shape [rows, vocab], got {shape}")
    check_vocab_size(shape[1], max_vocab_size)
    logits = input_to_torch(tensor, device)
    if logits.dtype != logits_dtype:
        raise SamplingRequestError(
            LOGITS,
            f"logits must be {str(logits_dtype).removeprefix('torch.')}, "
            f"got {str(logits.dtype).removeprefix('torch.')}",
        )
    return ParsedRequest(logits=logits, params=read_params(request, pb_utils, shape[0]))


def error_response(pb_utils, message: str, code_name: str = "INVALID_ARG"):
    """A per-request error response (INVALID_ARG: HTTP 400 / gRPC INVALID_ARGUMENT)."""
    code = getattr(pb_utils.TritonError, code_name)
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def wanted_outputs(request, declared: set[str]) -> set[str]:
    """The outputs to send: those the client asked for, or every declared one when it named none."""
    requested = set(request.requested_output_names())
    return declared & requested if requested else declared


def sampler_response(pb_utils, outputs: dict[str, np.ndarray], wanted: set[str] | None = None):
    """A response carrying the sampler outputs (numpy arrays keyed by output name), only the
    `wanted` ones when given: bytes not asked for are never built into a tensor or sent."""
    tensors = [
        pb_utils.Tensor(name, np.ascontiguousarray(to_wire_values(name, value)))
        for name, value in outputs.items()
        if wanted is None or name in wanted
    ]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _input(request, pb_utils, spec: InputSpec) -> np.ndarray | None:
    """A generate input as a flat numpy array of its table dtype, one per request (batch size 1);
    None when an optional one is absent."""
    values = read_input(request, pb_utils, spec.name, spec.dtype, spec.required)
    if values is None:
        return None
    if values.ndim < 1 or values.shape[0] != 1:
        raise SamplingRequestError(
            spec.name,
            f"{spec.name}: generate takes one prompt per request (batch size 1), got shape {list(values.shape)}",
        )
    values = values.reshape(-1)
    if spec.per == ROW and values.size != 1:
        raise SamplingRequestError(spec.name, f"{spec.name} must hold one value, got {values.size}")
    return values


def _flag(request, pb_utils, spec: InputSpec) -> bool:
    values = _input(request, pb_utils, spec)
    return False if values is None else bool(values[0])


def parse_generation_request(request, pb_utils, vocab_size: int, context_length: int) -> GenerationRequest:
    """A GenerationRequest from a Triton request; raises SamplingRequestError naming a bad field."""
    prompt = _input(request, pb_utils, INPUT_IDS).astype(np.int64)
    budget = int(_input(request, pb_utils, MAX_NEW_TOKENS)[0])
    stops = _input(request, pb_utils, STOP_TOKEN_IDS)
    stops = np.zeros(0, np.int64) if stops is None else stops.astype(np.int64)
    check_generation_request(prompt, budget, stops, vocab_size, context_length)
    return GenerationRequest(
        prompt=prompt,
        max_new_tokens=budget,
        stop_token_ids=stops,
        ignore_eos=_flag(request, pb_utils, IGNORE_EOS),
        stream=_flag(request, pb_utils, STREAM),
        params=read_params(request, pb_utils, rows=1),
    )


# A finish reason as its [1, 1] tensor value, built once per reason (every streamed token sends one).
_FINISH_REASONS: dict[str, np.ndarray] = {}


def _finish_reason(reason: str) -> np.ndarray:
    value = _FINISH_REASONS.get(reason)
    if value is None:
        value = _FINISH_REASONS[reason] = np.array([[reason.encode()]], dtype=FINISH_REASON.dtype)
        value.flags.writeable = False
    return value


def chunk_response(pb_utils, chunk: GenerationChunk, wanted: set[str] | None = None, held: dict | None = None):
    """A response with a chunk's outputs (the `wanted` ones when given), each with the leading
    batch dimension of 1. The chunk holds the values as sent already (the engine converts a
    step's outputs once, not once per response). With `held` (one dict per request, kept between
    its responses), the shared outputs are sent compactly (`outputs.compact_shared`); without it,
    one value per token."""
    outputs = chunk.outputs if held is None else _compacted(chunk.outputs, wanted, held)
    tensors = [
        pb_utils.Tensor(name, np.ascontiguousarray(value)[np.newaxis])
        for name, value in outputs.items()
        if wanted is None or name in wanted
    ]
    if wanted is None or FINISH_REASON.name in wanted:
        tensors.append(pb_utils.Tensor(FINISH_REASON.name, _finish_reason(chunk.finish_reason)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _compacted(outputs: dict[str, np.ndarray], wanted: set[str] | None, held: dict) -> dict[str, np.ndarray]:
    """`outputs` with the shared outputs `wanted` as `compact_shared` sends them, given `held`
    (the values the request's earlier responses left the client with, updated here)."""
    compact = outputs
    for name in SHARED_TOKEN_OUTPUT_NAMES:
        if wanted is not None and name not in wanted:
            continue
        values, before = outputs[name], held.get(name)
        # a streamed token with its request's value so far: the common case, decided inline
        if values.shape[0] == 1 and before is not None and values[0] == before:
            sent = None
        else:
            sent, held[name] = compact_shared(values, before)
            if sent is values:
                continue
        if compact is outputs:
            compact = dict(outputs)
        if sent is None:
            del compact[name]
        else:
            compact[name] = sent
    return compact
