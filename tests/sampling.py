"""Small helpers to call the torch sampler from numpy in the unit tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from triton_sampling_mask.sampling.sampler import SamplingBatch, sample

# The sampler's test budgets, one number each for every path: property-test examples against the
# reference, and draws of a chi-square test of the sampled distribution. The fused kernels'
# interpreter tests run them in full under the `slow` marker (a smaller share by default).
REFERENCE_EXAMPLES = 300
DISTRIBUTION_DRAWS = 40000

# Where the sampler tests run: the CPU path, the GPU path's torch ops on CPU tensors (the margin
# top-k with its boundary tie repair, the top-p candidates, the torch epilogue: what a KIND_GPU
# instance runs for the rows the fused kernels do not take), and CUDA (the fused kernels, as a GPU
# instance runs them) where a GPU is present. `pytest -m gpu tests/` runs only the CUDA cases.
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu-ops-on-cpu", id="gpu-ops-on-cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available(), reason="no CUDA device here; run `pytest -m gpu tests/` on a GPU"
            ),
        ],
    ),
]
# Each name in DEVICES: the tensors' device and the sampler's device path (None: the device's own).
_PLACES = {"cpu": ("cpu", None), "gpu-ops-on-cpu": ("cpu", "gpu"), "cuda": ("cuda", None)}
_device = {"name": "cpu"}
# Where tests run the fused kernels: natively on a GPU, else on CPU tensors under the interpreter.
FUSED_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def use_device(name: str) -> None:
    """Make `run_sampler` run where DEVICES' `name` says (set per test by the `sampler_device` fixture)."""
    _device["name"] = name


def run_sampler(
    logits,
    temperature=1.0,
    top_k=-1,
    top_p=1.0,
    min_p=0.0,
    seed=0,
    want_mask=True,
    mask_width=64,
    fused=None,
    device_path=None,
    dtype=torch.float32,
    device=None,
):
    """Sample rows of `logits` [B, V] (sent as `dtype`) on `device`; scalar parameters are broadcast
    over the rows. `device`, `fused` and `device_path` as `sample` reads them, None: as use_device
    set them."""
    place, default_path = _PLACES[_device["name"]]
    device = device or place
    logits = torch.as_tensor(np.asarray(logits, dtype=np.float32)).to(device, dtype)
    rows = logits.shape[0]
    column = lambda value, dtype: np.broadcast_to(np.asarray(value), (rows,)).astype(dtype)  # noqa: E731
    batch = SamplingBatch.from_arrays(
        logits=logits,
        temperature=column(temperature, np.float32),
        top_k=column(top_k, np.int64),
        top_p=column(top_p, np.float32),
        min_p=column(min_p, np.float32),
        seed=column(seed, np.int64),
        want_mask=column(want_mask, np.bool_),
    )
    host = sample(batch, mask_width, fused=fused, device_path=device_path or default_path).host()
    return {
        "ids": host["output_ids"],
        "logprobs": host["output_logprobs"],
        "mask": host["sampling_mask"],
        "mask_len": host["sampling_mask_len"],
        "mask_logprobs": host["sampling_logprobs"],
        "support_logprobs": host["sampling_mask_logprobs"],
    }


@st.composite
def sampling_cases(draw, max_rows: int = 5, unbounded_top_k: bool = True, mask_widths: tuple[int, ...] = ()):
    """Random batches: real-valued or tied integer logits (some -inf), mixed per-row parameters
    (top_k -1 among them when `unbounded_top_k`; a `mask_width` drawn from `mask_widths` if any)."""
    rows = draw(st.integers(1, max_rows))
    vocab = draw(st.integers(1, 80))
    tied = draw(st.booleans())
    element = st.integers(-3, 3).map(float) if tied else st.floats(-30, 30, width=32)
    logits = np.array(
        draw(st.lists(st.lists(element, min_size=vocab, max_size=vocab), min_size=rows, max_size=rows)), np.float32
    )
    banned = np.array(
        draw(st.lists(st.lists(st.booleans(), min_size=vocab, max_size=vocab), min_size=rows, max_size=rows))
    )
    banned[:, 0] = False  # keep at least one finite logit per row
    logits[banned & draw(st.booleans())] = -np.inf
    per_row = lambda strategy: draw(st.lists(strategy, min_size=rows, max_size=rows))  # noqa: E731
    top_k = st.integers(1, vocab + 3)
    case = dict(
        logits=logits,
        temperature=np.array(per_row(st.one_of(st.just(0.0), st.floats(0.0625, 4.0, width=32))), np.float32),
        top_k=np.array(per_row(st.one_of(st.just(-1), top_k) if unbounded_top_k else top_k), np.int64),
        top_p=np.array(per_row(st.one_of(st.just(1.0), st.floats(0.0078125, 1.0, width=32))), np.float32),
        min_p=np.array(per_row(st.one_of(st.just(0.0), st.floats(0.0, 0.9375, width=32))), np.float32),
        seed=np.array(per_row(st.integers(-(2**63), 2**63 - 1)), np.int64),
        want_mask=np.array(per_row(st.booleans())),
    )
    if mask_widths:
        case["mask_width"] = draw(st.sampled_from(mask_widths))
    return case
