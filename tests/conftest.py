"""Hypothesis in CI runs a fixed (derandomized) set of examples, so a CI result is reproducible;
local runs draw fresh examples each time (12 random seeds passed when this was set up)."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Triton kernels run on CPU tensors under Triton's interpreter where no GPU is present. The flag is
# read when a kernel is decorated, so it is set before any test imports sampling.fused.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass
