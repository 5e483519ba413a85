"""Weights a compat trainer broadcasts: the served default tiny Llama's own (float32) and the same moved by
a seeded step, saved where a driver (another venv) loads them."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.weights_fixtures import moved_model
from triton_sampling_mask.generation.lm import build_default_model


def save(model, path: Path) -> str:
    from safetensors.torch import save_file

    save_file({name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}, str(path))
    return str(path)


@pytest.fixture(scope="session")
def weight_files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("compat_weights")
    return {
        "original": save(build_default_model(), root / "original.safetensors"),
        "moved": save(moved_model(5), root / "moved.safetensors"),
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
