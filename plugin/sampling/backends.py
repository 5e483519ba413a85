"""Sampling backends: a small registry; each backend says whether it builds the support.

A deployment picks one with the `sampling_backend` config parameter: a registered name, or a
custom class as "package.module:Class" (like SGLang's `register_sampler_backend`). Mask requests
on a backend that builds no support are refused per request; an unknown name fails model load.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from .results import SamplingResult
from .sampler import SamplingBatch, sample


@runtime_checkable
class SamplingBackend(Protocol):
    """What the model needs of a backend."""

    name: str
    builds_support: bool  # False: the backend never materialises the support, so no masks

    def sample(self, batch: SamplingBatch, mask_width: int) -> SamplingResult: ...


class TorchSamplingBackend:
    """The built-in sampler (CPU and GPU); builds the support, so it serves masks.

    `fused`: run the finite-top_k rows through the Triton kernels (default: on CUDA when Triton
    is importable; True also runs them on CPU tensors under TRITON_INTERPRET=1, for tests).
    `device_path`: the ops of the other rows, "cpu" or "gpu" (default: the device's; "gpu" also
    runs on CPU tensors, for tests)."""

    name = "torch"
    builds_support = True

    def __init__(self, fused: bool | None = None, device_path: str | None = None):
        self.fused = fused
        self.device_path = device_path

    def sample(self, batch: SamplingBatch, mask_width: int) -> SamplingResult:
        return sample(batch, mask_width, fused=self.fused, device_path=self.device_path)


def import_object(spec: str, parameter: str):
    """The object a config parameter names as "package.module:attr" (a custom backend or LM);
    a bad spec fails model load with a message naming the parameter."""
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{parameter} {spec!r} could not be imported: {exc}") from exc


_REGISTRY: dict[str, Callable[[], SamplingBackend]] = {"torch": TorchSamplingBackend}


def register_sampling_backend(name: str, factory: Callable[[], SamplingBackend]) -> None:
    """Make `factory` available under `name` for the `sampling_backend` parameter."""
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    """Registered backend names, sorted."""
    return sorted(_REGISTRY)


def load_backend(spec: str) -> SamplingBackend:
    """Instantiate the backend named by `spec` (a registered name or "package.module:Class")."""
    if spec in _REGISTRY:
        backend = _REGISTRY[spec]()
    elif ":" in spec:
        backend = import_object(spec, "sampling_backend")()
    else:
        choices = ", ".join(available_backends())
        raise ValueError(
            f"unknown sampling_backend {spec!r}; choose one of: {choices}, "
            "or a custom backend as 'package.module:Class'"
        )
    if not isinstance(backend, SamplingBackend):
        raise ValueError(f"sampling_backend {spec!r} lacks name, builds_support or sample()")
    return backend
