"""The package's dependencies point one way: each subpackage imports with the others' heavy
dependencies (and the layers above it) made unimportable, in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# subpackage -> top-level modules it must never need (an import of any of them fails the test).
FORBIDDEN = {
    "sampling": [
        "triton_python_backend_utils",
        "tritonclient",
        "transformers",
        "triton_sampling_mask.serving",
        "triton_sampling_mask.client",
        "triton_sampling_mask.generation",
        "triton_sampling_mask.ops",
        "triton_sampling_mask.model_config",
    ],
    "generation": [
        "triton_python_backend_utils",
        "tritonclient",
        "triton_sampling_mask.serving",
        "triton_sampling_mask.client",
        "triton_sampling_mask.ops",
    ],
    "client": [
        "triton_python_backend_utils",
        "transformers",
        "triton_sampling_mask.serving",
        "triton_sampling_mask.generation",
        "triton_sampling_mask.ops",
    ],
    "serving": [
        "triton_python_backend_utils",
        "tritonclient",
        "triton_sampling_mask.client",
        "triton_sampling_mask.ops",
    ],
}

PROBE = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    forbidden = sys.argv[2:]

    class Block:
        def find_spec(self, name, path=None, target=None):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                raise ImportError(f"blocked by the layering test: {name}")
            return None

    sys.meta_path.insert(0, Block())
    package = importlib.import_module("triton_sampling_mask." + sys.argv[1])
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    print("ok")
    """
)


@pytest.mark.parametrize("subpackage", sorted(FORBIDDEN))
def test_subpackage_imports_without_the_layers_above(subpackage):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, subpackage, *FORBIDDEN[subpackage]], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_probe_blocks_what_it_names():
    # The test above can fail: importing the client with tritonclient blocked must fail.
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "client", "tritonclient"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "blocked by the layering test: tritonclient" in done.stderr


@pytest.mark.parametrize(
    "old, new",
    [
        ("converters", "client.converters"),
        ("replay", "client.replay"),
        ("sampling_params", "client.sampling_params"),
        ("sampler", "sampling.sampler"),
        ("launcher", "ops.launcher"),
        ("gpu_repository", "ops.gpu_repository"),
    ],
)
def test_documented_old_import_paths_give_the_moved_module(old, new):
    import importlib

    moved = importlib.import_module(f"triton_sampling_mask.{new}")
    assert importlib.import_module(f"triton_sampling_mask.{old}") is moved
    assert moved.__spec__.name == f"triton_sampling_mask.{new}"


def test_old_launcher_path_runs_with_python_m():
    done = subprocess.run(
        [sys.executable, "-m", "triton_sampling_mask.gpu_repository", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "Derive the GPU model repository" in done.stdout, done.stderr
