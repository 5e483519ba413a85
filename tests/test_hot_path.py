"""What a decode step costs on the CUDA code path, counted on CPU: the fused path runs with CPU
tensors (its Triton kernels under TRITON_INTERPRET=1) through the same `BatchSampler.run` an
`execute` calls, and every aten op, kernel launch, host sync and float64 tensor is counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from triton_sampling_mask.sampling import fused
from triton_sampling_mask.sampling.backends import TorchSamplingBackend
from triton_sampling_mask.sampling.batching import BatchSampler
from triton_sampling_mask.sampling.params import RowParams
from triton_sampling_mask.sampling.validation import MaskPolicy

from .reference import reference_row

pytestmark = pytest.mark.skipif(not fused.AVAILABLE, reason="triton is not installed (the `test` extra brings it)")

WIDTH, VOCAB = 64, 32000
# On a GPU these are the real CUDA kernels and syncs; elsewhere the same path on CPU tensors.
DEVICE = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
LAUNCH_BUDGET = 8  # aten ops + Triton launches per execute on the finite-top_k path

# Host synchronisations: a device tensor read from the host stops the CPU running ahead.
SYNCING = {
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class CountSyncs(TorchFunctionMode):
    """Records every host-synchronising call (and `.to("cpu")`)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # .to("cpu") syncs when it moves a device tensor to the host (on CPU tensors it is a no-op).
        to_cpu = (
            func is torch.Tensor.to
            and args[0].device.type != "cpu"
            and any(str(a).startswith("cpu") for a in (*args[1:], *kwargs.values()))
        )
        if func in SYNCING or to_cpu:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


class CountOps(TorchDispatchMode):
    """Counts aten ops dispatched and remembers float64 outputs of `min_elements` or more."""

    def __init__(self, min_elements: int):
        super().__init__()
        self.ops: list[str] = []
        self.large_float64: list[str] = []
        self.min_elements = min_elements

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func.overloadpacket))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.dtype == torch.float64
                and tensor.numel() >= self.min_elements
            ):
                self.large_float64.append(str(func))
        return out


def requests(rows: int, vocab: int = VOCAB, seed: int = 0):
    generator = np.random.default_rng(seed)
    logits = torch.from_numpy((generator.standard_normal((rows, vocab)) * 3).astype(np.float32)).to(DEVICE)
    params = RowParams.defaults(rows)
    params.temperature[:] = 0.8
    params.top_k[:] = generator.integers(1, WIDTH + 1, rows)
    params.top_p[:] = 0.95
    params.seed[:] = np.arange(rows, dtype=np.uint64) + np.uint64(2**63)
    params.has_seed[:] = True
    params.return_sampling_mask[:] = True
    return logits, params


@pytest.fixture(autouse=True)
def kernels_uncounted(monkeypatch):
    """Under the interpreter a kernel's body runs as host code (with torch calls of its own); on a
    GPU it is one launch. Counting stops inside a launch, which `fused.LAUNCHES` counts instead."""
    from torch.utils._python_dispatch import _disable_current_modes

    launch = fused._launch

    def uncounted(*args, **kwargs):
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            return launch(*args, **kwargs)

    monkeypatch.setattr(fused, "_launch", uncounted)


def fused_sampler() -> BatchSampler:
    return BatchSampler(TorchSamplingBackend(fused=True), MaskPolicy(WIDTH, "sampler/config.pbtxt"), DEVICE)


# The counts do not depend on the vocabulary; B=64 uses a small one because the interpreter runs
# each kernel program as Python.
@pytest.mark.parametrize("rows, vocab", [(1, VOCAB), (64, 2048)])
def test_execute_on_the_fused_path_is_sync_free_fp32_and_within_the_launch_budget(rows, vocab):
    sampler = fused_sampler()
    batch = [requests(rows, vocab)]
    sampler.run([requests(1, vocab)])  # warm-up: kernel compilation is not the step's cost
    launches_before = fused.LAUNCHES
    with CountOps(min_elements=vocab) as ops, CountSyncs() as syncs:
        outcome = sampler.run(batch)[0]
    launches = fused.LAUNCHES - launches_before
    assert outcome.error is None
    assert launches == 2, "the row-statistics and the candidate kernels, once each"
    assert len(ops.ops) + launches <= LAUNCH_BUDGET, ops.ops
    # The one copy back: the packed outputs, after every kernel has been queued.
    assert syncs.calls == ["cpu", "numpy"], syncs.calls
    assert ops.large_float64 == []


def test_several_requests_in_one_execute_stay_within_the_budget():
    sampler = fused_sampler()
    batch = [requests(3, 2048, seed=1), requests(5, 2048, seed=2), requests(1, 2048, seed=3)]
    sampler.run([requests(1, 2048)])
    with CountOps(min_elements=2048) as ops, CountSyncs() as syncs:
        outcomes = sampler.run(batch)
    assert all(o.error is None for o in outcomes)
    assert len(ops.ops) + 2 <= LAUNCH_BUDGET, ops.ops  # + the concatenation of the requests' logits
    assert syncs.calls == ["cpu", "numpy"]


def test_fused_execute_answers_match_the_reference_and_the_torch_path():
    logits, params = requests(8, vocab=5000, seed=4)
    fused_out = fused_sampler().run([(logits, params)])[0].outputs
    torch_out = (
        BatchSampler(TorchSamplingBackend(fused=False), MaskPolicy(WIDTH, "x"), DEVICE)
        .run([(logits, params)])[0]
        .outputs
    )
    for row in range(8):
        ref = reference_row(logits[row].cpu().numpy(), 0.8, int(params.top_k[row]), 0.95, tolerance=1e-5)
        length = int(fused_out["sampling_mask_len"][row, 0])
        assert ref.support_min <= length <= ref.support_max
        np.testing.assert_array_equal(fused_out["sampling_mask"][row, :length], ref.order[:length])
        token = int(fused_out["output_ids"][row, 0])
        assert token in ref.order[:length]
        assert fused_out["sampling_logprobs"][row, 0] == pytest.approx(
            ref.renormalised_logprob(token, length), abs=1e-5
        )
    # Same seeds, same uniforms on both paths: the tokens agree (fp32 vs fp64 scores can only
    # differ on a near-tie of the Gumbel-perturbed scores, which these rows do not have).
    np.testing.assert_array_equal(fused_out["output_ids"], torch_out["output_ids"])


def test_bad_logits_fail_only_their_request_on_the_fused_path():
    good_logits, good_params = requests(2, vocab=3000, seed=5)
    bad_logits, bad_params = requests(2, vocab=3000, seed=6)
    bad_logits[1, 7] = float("nan")
    outcomes = fused_sampler().run([(good_logits, good_params), (bad_logits, bad_params)])
    assert outcomes[0].error is None and outcomes[0].outputs["output_ids"].shape == (2, 1)
    assert outcomes[1].error == "logits must not contain NaN (row 1)" and outcomes[1].reason == "logits_nan"
