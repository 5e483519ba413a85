"""tritonclient input tensors for the sampler's inputs, with wire datatypes from the parameter specs.

Shared by the client tests, the soak tool and the served benchmark (no test helper is imported
by a benchmark or a tool).
"""

from __future__ import annotations

import numpy as np
from tritonclient.utils import np_to_triton_dtype

from ..sampling.params import LOGITS, PARAM_SPECS

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
        array = np.asarray(value, dtype=NUMPY_DTYPES[datatype])
        if array.ndim == 0:
            array = np.full((rows, 1), array, dtype=array.dtype)
        inputs.append(infer_input(module, name, array.reshape(rows, 1), datatype))
    return inputs
