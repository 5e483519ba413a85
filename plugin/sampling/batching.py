"""From many requests to one vectorised sampler call and back (no Triton here).

Requests are grouped by vocabulary size, their rows stacked, every rule checked over all rows at
once, and only the rows of valid requests sampled. A bad row fails its own request only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .backends import SamplingBackend
from .outputs import SAMPLING_SEED, to_wire
from .params import RowParams
from .results import ROW_MAX, SamplingResult
from .sampler import SamplingBatch
from .validation import MaskPolicy, check_logit_rows, check_rows, first_error


@dataclass
class RequestOutcome:
    """A request's answer: `error` (a user-error message) or `outputs` (numpy arrays by name)."""

    error: str | None = None
    outputs: dict[str, np.ndarray] | None = None
    reason: str = "ok"  # for metrics: "ok" or the Rejection reason


class BatchSampler:
    """Samples the rows of many requests in one call per vocabulary size."""

    def __init__(self, backend: SamplingBackend, policy: MaskPolicy, device: torch.device):
        self.backend = backend
        self.policy = policy
        self.device = device
        # Unseeded rows draw a fresh 64-bit seed from here (all 2**64 streams reachable); seeded
        # rows never touch it.
        self._entropy = np.random.default_rng(int.from_bytes(os.urandom(16), "little"))

    def run(self, requests: list[tuple[torch.Tensor, RowParams]]) -> list[RequestOutcome]:
        """Answer each (logits [rows, V], params) request; the list keeps the input order."""
        outcomes: list[RequestOutcome | None] = [None] * len(requests)
        by_vocab: dict[int, list[int]] = {}
        for position, (logits, _) in enumerate(requests):
            by_vocab.setdefault(logits.shape[1], []).append(position)
        for vocab, positions in by_vocab.items():
            group = [requests[p] for p in positions]
            for position, outcome in zip(positions, self._run_group(group, vocab)):
                outcomes[position] = outcome
        return outcomes

    def _run_group(self, group, vocab: int) -> list[RequestOutcome]:
        rows_per_request = np.array([logits.shape[0] for logits, _ in group])
        logits = group[0][0] if len(group) == 1 else torch.cat([lg for lg, _ in group])
        params = RowParams.concatenate([p for _, p in group])
        # Parameter rules first, on the host; the logits rules need each row's max, which the
        # sampler returns with its results (one device-to-host copy, no separate pass).
        errors = check_rows(params, None, vocab, self.policy)
        owner = np.repeat(np.arange(len(group)), rows_per_request)
        sampled = ~_failed_requests(errors, owner, len(group))[owner]
        result_arrays = seeds = None
        row_max = np.empty(len(owner), np.float32)
        if sampled.any():
            rows = logits if sampled.all() else logits[torch.from_numpy(np.flatnonzero(sampled)).to(logits.device)]
            seeded = self.seeded(params.take(sampled))
            seeds = seeded.seed  # each row's receipt: the seed its noise used
            result_arrays = self.sample(rows, seeded).host()
            row_max[sampled] = result_arrays[ROW_MAX]
        if (~sampled).any():  # error path only: the refused requests' other rows, for "first failing row"
            unsampled = torch.from_numpy(np.flatnonzero(~sampled)).to(logits.device)
            row_max[~sampled] = logits[unsampled].amax(dim=-1).float().cpu().numpy()
        # The logits rules come last (check_rows' order): only rows every parameter rule passed.
        passed = np.equal(errors, None).astype(bool)
        errors[passed] = check_logit_rows(row_max[passed])

        request_failed = _failed_requests(errors, owner, len(group))
        outcomes = [RequestOutcome() for _ in group]
        for r in np.flatnonzero(request_failed):  # error path only
            start = rows_per_request[:r].sum()
            error = first_error(errors[start : start + rows_per_request[r]])
            outcomes[r] = RequestOutcome(error=error.message, reason=error.reason)
        answered = ~request_failed[owner]
        if answered.any():
            # The sampler's scalar outputs are dims [ 1 ] per row on the wire.
            keep = answered[sampled]
            wire = {**to_wire(result_arrays), SAMPLING_SEED.name: seeds}
            arrays = {name: value[keep].reshape(int(keep.sum()), -1) for name, value in wire.items()}
            splits = np.cumsum(rows_per_request[~request_failed])[:-1]
            chunks = {name: np.split(value, splits) for name, value in arrays.items()}
            for i, r in enumerate(np.flatnonzero(~request_failed)):
                outcomes[r].outputs = {name: chunks[name][i] for name in chunks}
        return outcomes

    def seeded(self, params: RowParams) -> RowParams:
        """These rows, every one seeded: an unseeded row draws a fresh 64-bit seed here."""
        if params.has_seed.all():
            return params
        fresh = self._entropy.integers(0, 2**64, params.rows, dtype=np.uint64, endpoint=False)
        return params.with_seeds(fresh)

    def sample(self, logits: torch.Tensor, params: RowParams) -> SamplingResult:
        """Sample already-validated rows (used by every model that drives the sampler); unseeded
        rows are seeded first (`seeded`)."""
        batch = SamplingBatch(logits.to(self.device), self.seeded(params))
        return self.backend.sample(batch, self.policy.mask_width)


def _failed_requests(errors: np.ndarray, owner: np.ndarray, requests: int) -> np.ndarray:
    """Which requests have at least one refused row."""
    row_failed = ~np.equal(errors, None).astype(bool)
    return np.bincount(owner[row_failed], minlength=requests) > 0


def outputs_to_numpy(result: SamplingResult) -> dict[str, np.ndarray]:
    """Sampler outputs by output name in the wire dtypes: [rows] scalars, [rows, W] mask."""
    return to_wire(result.host())
