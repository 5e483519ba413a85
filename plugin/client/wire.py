"""tritonclient input tensors for the sampler's inputs, with wire datatypes from the parameter specs.

Shared by the client tests, the soak tool and the served benchmark (no test helper is imported
by a benchmark or a tool).
"""

from __future__ import annotations

import numpy as np
from tritonclient.utils import np_to_triton_dtype

from ..sampling.params import LOGITS, PARAM_SPECS
from ..sampling.validation import SamplingRequestError

# Wire datatypes derived from the parameter specs (sampling/params.py), the one source of truth.
INPUT_DTYPES = {LOGITS: "FP32", **{spec.name: np_to_triton_dtype(np.dtype(spec.dtype)) for spec in PARAM_SPECS}}
NUMPY_DTYPES = {np_to_triton_dtype(np.dtype(dtype)): dtype for dtype in (np.float32, np.int32, np.uint64, np.bool_)}


def infer_input(module, name: str, array: np.ndarray, datatype: str):
    """A tritonclient InferInput holding `array` (module: tritonclient.http or tritonclient.grpc)."""
    tensor = module.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def sampler_inputs(module, logits: np.ndarray, **params) -> list:
    """InferInputs for logits [B, V] and per-row parameters given as scalars (repeated per row)
    or length-B sequences."""
    logits = np.asarray(logits, dtype=np.float32)
    rows = logits.shape[0]
    inputs = [infer_input(module, LOGITS, logits, INPUT_DTYPES[LOGITS])]
    for name, value in params.items():
        datatype = INPUT_DTYPES[name]
        array = _fitting(name, value, NUMPY_DTYPES[datatype])
        if array.ndim == 0:
            array = np.full((rows, 1), array, dtype=array.dtype)
        inputs.append(infer_input(module, name, array.reshape(rows, 1), datatype))
    return inputs


def _fitting(name: str, value, dtype) -> np.ndarray:
    """`value` as an array of `dtype`; an integer outside the dtype's range is refused with its true
    value (a cast would wrap it: 2**31 as INT32 is -2**31), naming the input."""
    array = np.asarray(value)
    if np.issubdtype(np.dtype(dtype), np.integer) and array.size and array.dtype.kind in "iuO":
        limits = np.iinfo(dtype)
        outside = [int(v) for v in array.ravel().tolist() if not limits.min <= int(v) <= limits.max]
        if outside:
            raise SamplingRequestError(
                name,
                f"{name} must be an integer in [{limits.min}, {limits.max}] ({np.dtype(dtype).name}), got {outside[0]}",
            )
    return array.astype(dtype)
