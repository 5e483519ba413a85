"""What the front door reads of each model's config.pbtxt: whether it is a generator (decoupled),
the largest body a request to it may carry, and its inputs (what the JSON checks accept on
/generate). `ops.proxy` writes them into HAProxy's map files; the stream gate takes the largest cap.

A body cap is max_batch_size rows of every input at its largest, a -1 dimension bounded by the
first of VARIABLE_DIM_BOUNDS among the config's parameters (none: UNBOUNDED_MODEL_BODY_BYTES),
times the JSON text factor for generators (they take JSON on /generate), plus the JSON header and
slack for scalars and names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..model_config import dims, is_decoupled, read_config_file, string_parameters
from ..sampling.admin import ADMIN_KEY_PARAMETER

VARIABLE_DIM_BOUNDS = ("max_vocab_size", "kv_budget_tokens")
UNBOUNDED_MODEL_BODY_BYTES = 64 * 2**20
JSON_TEXT_FACTOR = 3  # an integer as JSON text (sign, 10 digits, comma) against 4 bytes binary
BODY_SLACK_BYTES = 64 * 1024
DTYPE_BYTES = {"BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2}
DTYPE_BYTES |= {"UINT32": 4, "INT32": 4, "FP32": 4}  # 8: 64-bit types, and strings


@dataclass(frozen=True)
class ModelRoute:
    """One model as the door sees it: a generator or not, its body cap, and its inputs as
    "name:DATATYPE ..."."""

    name: str
    decoupled: bool
    body_limit_bytes: int
    input_spec: str = ""


def model_route(config_path: Path, json_header_bytes: int) -> ModelRoute:
    """A model's route from its config.pbtxt (Triton requires the folder's name)."""
    config = read_config_file(config_path)
    inputs = config.get("input", [])
    # a control request's admin key is a request parameter: a string beside the inputs
    kinds = [(e["name"], e.get("data_type", "TYPE_INVALID")[5:]) for e in inputs] + [(ADMIN_KEY_PARAMETER, "STRING")]
    spec = " ".join(f"{name}:{'BYTES' if kind == 'STRING' else kind}" for name, kind in kinds)
    parameters = string_parameters(config)
    bound = next((int(parameters[key]) for key in VARIABLE_DIM_BOUNDS if parameters.get(key, "").isdigit()), None)
    route = ModelRoute(Path(config_path).parent.name, is_decoupled(config), UNBOUNDED_MODEL_BODY_BYTES, spec)
    row_bytes = 0
    for entry in (entry for entry in inputs if "data_type" in entry and dims(entry)):
        if bound is None and min(dims(entry)) < 0:
            return route
        elements = 1
        for dim in dims(entry):
            elements *= bound if dim < 0 else dim
        row_bytes += elements * DTYPE_BYTES.get(entry["data_type"][5:], 8)
    body = max(1, int(config.get("max_batch_size", 0))) * row_bytes * (JSON_TEXT_FACTOR if route.decoupled else 1)
    return ModelRoute(route.name, route.decoupled, body + json_header_bytes + BODY_SLACK_BYTES, spec)


def model_routes(repository: Path, json_header_bytes: int) -> list[ModelRoute]:
    """Every model of a repository (each folder with a config.pbtxt), by name."""
    return [model_route(path, json_header_bytes) for path in sorted(Path(repository).glob("*/config.pbtxt"))]
