"""The sampling backend registry: names and "package.module:Class" specs resolved, every bad spec
refused with a message naming the `sampling_backend` parameter and the spec as given."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from triton_sampling_mask.sampling import backends
from triton_sampling_mask.sampling.backends import (
    TorchSamplingBackend,
    available_backends,
    import_object,
    load_backend,
    register_sampling_backend,
)
from triton_sampling_mask.sampling.params import RowParams
from triton_sampling_mask.sampling.sampler import SamplingBatch


class CountingBackend:
    """A custom backend as a deployment would name it ("tests.test_backends:CountingBackend")."""

    name = "counting"
    builds_support = False

    def sample(self, batch, mask_width):
        raise NotImplementedError


class NoSample:
    """Lacks `sample()`: not a backend."""

    name = "no-sample"
    builds_support = True


@pytest.fixture
def registry(monkeypatch):
    """The registry as shipped, restored after the test."""
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))


def test_the_builtin_backend_is_the_torch_sampler_and_builds_the_support(registry):
    backend = load_backend("torch")
    assert type(backend) is TorchSamplingBackend
    assert (backend.name, backend.builds_support, backend.fused, backend.device_path) == ("torch", True, None, None)
    assert available_backends() == ["torch"]


def test_the_builtin_backend_samples_with_its_own_options():
    # The greedy token of each row, so the expected ids need no reference sampler.
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.5]])
    params = RowParams.defaults(2)
    params.temperature = np.zeros(2, np.float32)
    for device_path in ("cpu", "gpu"):
        backend = TorchSamplingBackend(fused=False, device_path=device_path)
        host = backend.sample(SamplingBatch(logits, params.with_seeds(np.arange(2, dtype=np.uint64))), 3).host()
        np.testing.assert_array_equal(host["output_ids"], [1, 0])
    with pytest.raises(ValueError, match="device_path must be one of"):
        TorchSamplingBackend(fused=False, device_path="tpu").sample(
            SamplingBatch(logits, params.with_seeds(np.arange(2, dtype=np.uint64))), 3
        )


def test_a_registered_name_builds_its_factory_and_is_listed_sorted(registry):
    register_sampling_backend("counting", CountingBackend)
    register_sampling_backend("a-first", CountingBackend)
    assert available_backends() == ["a-first", "counting", "torch"]
    backend = load_backend("counting")
    assert type(backend) is CountingBackend and not backend.builds_support


def test_a_custom_class_loads_by_its_module_path(registry):
    backend = load_backend(f"{__name__}:CountingBackend")
    assert type(backend) is CountingBackend
    assert available_backends() == ["torch"]  # loading by path registers nothing


def test_an_unknown_name_lists_every_choice(registry):
    register_sampling_backend("counting", CountingBackend)
    with pytest.raises(ValueError) as refused:
        load_backend("vllm")
    assert str(refused.value) == (
        "unknown sampling_backend 'vllm'; choose one of: counting, torch, or a custom backend as 'package.module:Class'"
    )


def test_a_class_that_is_no_backend_is_refused_naming_the_spec(registry):
    spec = f"{__name__}:NoSample"
    with pytest.raises(ValueError) as refused:
        load_backend(spec)
    assert str(refused.value) == f"sampling_backend {spec!r} lacks name, builds_support or sample()"


@pytest.mark.parametrize(
    ("spec", "cause"),
    [
        ("no_such_package.anywhere:Backend", "No module named 'no_such_package'"),
        (f"{__name__}:Missing", "has no attribute 'Missing'"),
        (":Backend", "Empty module name"),
    ],
)
def test_a_spec_that_does_not_import_names_the_parameter_and_the_spec(registry, spec, cause):
    with pytest.raises(ValueError) as refused:
        load_backend(spec)
    message = str(refused.value)
    assert message.startswith(f"sampling_backend {spec!r} could not be imported: ")
    assert cause in message
    assert isinstance(refused.value.__cause__, ImportError | AttributeError | ValueError)


def test_import_object_returns_the_named_attribute_and_names_its_parameter():
    assert import_object("numpy.linalg:norm", "lm") is np.linalg.norm
    with pytest.raises(ValueError) as refused:
        import_object("numpy", "lm")  # no ":attr": the empty attribute does not exist
    assert str(refused.value).startswith("lm 'numpy' could not be imported: ")
