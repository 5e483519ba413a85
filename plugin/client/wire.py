"""tritonclient input tensors for the models' inputs, with wire datatypes from the input table.

Shared by the client tests, the soak tool and the served benchmark (no test helper is imported
by a benchmark or a tool).
"""

from __future__ import annotations

import numpy as np

from ..sampling.inputs import GENERATE_INPUTS, SAMPLER_INPUTS
from ..sampling.params import LOGITS
from ..sampling.validation import SamplingRequestError

# Wire datatypes from the input table (sampling/inputs.py), the one source of truth.
INPUT_DTYPES = {spec.name: spec.datatype for spec in SAMPLER_INPUTS}
GENERATE_DTYPES = {spec.name: spec.datatype for spec in GENERATE_INPUTS}
NUMPY_DTYPES = {spec.datatype: spec.dtype for spec in (*SAMPLER_INPUTS, *GENERATE_INPUTS)}


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
