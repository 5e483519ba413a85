"""The HTTP API (plugin/api) as the front door runs it: whether it runs, and its command line.

It runs behind the proxy only, when the proxy has a public port for it, the repository has a
`generate` model and the `api` extra is installed; it listens on loopback, talks to tritonserver's
own gRPC port, and loads the generate model's `model_path` for its tokenizer.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ..model_config import read_config_file, string_parameters
from . import settings

GENERATE_MODEL = "generate"  # the model the HTTP API serves


def runs(repository: Path, public_port: int) -> bool:
    """Whether the HTTP API runs: a public port for it, a generate model, and its extra installed."""
    wanted = bool(public_port) and (Path(repository) / GENERATE_MODEL / "config.pbtxt").exists()
    return wanted and importlib.util.find_spec("fastapi") is not None


def command(door) -> list[str]:
    """The API on loopback behind `door` (an ops.proxy.FrontDoor), over tritonserver's gRPC port,
    with the generate model's checkpoint for its tokenizer, and the door's admin key file where
    trusted networks' keyless weight calls need it (TRITON_API_TRUSTED_NETWORKS)."""
    config = Path(door.repository) / GENERATE_MODEL / "config.pbtxt"
    model_path = string_parameters(read_config_file(config)).get("model_path", "") if config.exists() else ""
    trusted = door.admin_key is not None and settings.TRITON_API_TRUSTED_NETWORKS.value()
    return [
        *(sys.executable, "-m", "triton_sampling_mask.api", f"--triton-url=127.0.0.1:{door.internal['grpc']}"),
        *("--host=127.0.0.1", f"--port={door.internal['api']}"),
        *([f"--model-path={model_path}"] if model_path else []),
        *([f"--admin-key-file={door.directory / 'admin.key'}"] if trusted else []),
    ]
