"""Helpers for tests against a real tritonserver: test model repositories and tiny clients."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from triton_sampling_mask.client.wire import INPUT_DTYPES, NUMPY_DTYPES, sampler_inputs  # noqa: F401 (re-exported to tests)

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = REPO_ROOT / "model_repository"

# Variants of the sampler the tests load beside it: name -> config parameter overrides.
SAMPLER_VARIANTS = {
    "sampler_speculative": {"speculative_algorithm": "EAGLE"},
    "sampler_nosupport": {"sampling_backend": "no_support_backend:NoSupportBackend"},
}


def set_parameter(config_text: str, key: str, value: str) -> str:
    """Replace a `parameters` string value in config.pbtxt text (the key must be there)."""
    pattern = re.compile(r'(key:\s*"%s",\s*value:\s*\{\s*string_value:\s*)"[^"]*"' % re.escape(key))
    text, count = pattern.subn(lambda m: f'{m.group(1)}"{value}"', config_text)
    assert count == 1, f"parameter {key} not found in config"
    return text


def build_test_repository(dest: Path) -> Path:
    """The shipped model repository plus the sampler variants the tests need."""
    shutil.copytree(MODEL_REPOSITORY, dest, ignore=shutil.ignore_patterns("__pycache__"))
    base = (MODEL_REPOSITORY / "sampler" / "config.pbtxt").read_text()
    for name, overrides in SAMPLER_VARIANTS.items():
        variant = dest / name
        shutil.copytree(MODEL_REPOSITORY / "sampler", variant, ignore=shutil.ignore_patterns("__pycache__"))
        text = base.replace('name: "sampler"', f'name: "{name}"')
        for key, value in overrides.items():
            text = set_parameter(text, key, value)
        (variant / "config.pbtxt").write_text(text)
        shutil.copy(Path(__file__).parent / "no_support_backend.py", variant / "1")
    return dest


@dataclass
class ExternalTritonServer:
    """A server someone else started (docker/run-gpu-tests.sh): the URLs the tests need."""

    http_url: str
    grpc_url: str
    metrics_url: str

    @classmethod
    def from_environment(cls) -> "ExternalTritonServer | None":
        """The server named by TRITON_EXTERNAL_{HTTP,GRPC,METRICS}_URL, or None when unset."""
        if not os.environ.get("TRITON_EXTERNAL_HTTP_URL"):
            return None
        return cls(
            http_url=os.environ["TRITON_EXTERNAL_HTTP_URL"],
            grpc_url=os.environ["TRITON_EXTERNAL_GRPC_URL"],
            metrics_url=os.environ.get("TRITON_EXTERNAL_METRICS_URL", ""),
        )

    def log_tail(self, chars: int = 4000) -> str:
        return "(external server: see its own log)"


OUTPUTS = ("output_ids", "output_logprobs", "sampling_mask", "sampling_mask_len", "sampling_logprobs")


def infer(client, module, model: str, logits, **params) -> dict[str, np.ndarray]:
    """Run the sampler and return every output as numpy."""
    result = client.infer(model, sampler_inputs(module, logits, **params))
    return {name: result.as_numpy(name) for name in OUTPUTS}
