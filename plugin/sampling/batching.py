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
from .params import RowParams
from .sampler import SamplingBatch, SamplingResult
from .validation import MaskPolicy, check_rows, first_error

OUTPUT_NAMES = ("output_ids", "output_logprobs", "sampling_mask", "sampling_mask_len", "sampling_logprobs")


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
        # Unseeded rows draw a fresh 63-bit seed from here; seeded rows never touch it.
        self._entropy = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

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
        row_max = logits.amax(dim=-1).cpu().numpy() if logits.shape[0] else np.zeros(0, np.float32)
        errors = check_rows(params, row_max, vocab, self.policy)

        owner = np.repeat(np.arange(len(group)), rows_per_request)
        row_failed = ~np.equal(errors, None).astype(bool)
        request_failed = np.bincount(owner[row_failed], minlength=len(group)) > 0
        outcomes = [RequestOutcome() for _ in group]
        for r in np.flatnonzero(request_failed):  # error path only
            start = rows_per_request[:r].sum()
            error = first_error(errors[start : start + rows_per_request[r]])
            outcomes[r] = RequestOutcome(error=error.message, reason=error.reason)

        valid_rows = ~request_failed[owner]
        if valid_rows.any():
            subset = slice(None) if valid_rows.all() else torch.from_numpy(np.flatnonzero(valid_rows)).to(logits.device)
            result = self.sample(logits[subset], params.take(valid_rows))
            # The sampler's scalar outputs are dims [ 1 ] per row on the wire.
            arrays = {name: value.reshape(len(value), -1) for name, value in outputs_to_numpy(result).items()}
            splits = np.cumsum(rows_per_request[~request_failed])[:-1]
            chunks = {name: np.split(value, splits) for name, value in arrays.items()}
            for i, r in enumerate(np.flatnonzero(~request_failed)):
                outcomes[r].outputs = {name: chunks[name][i] for name in OUTPUT_NAMES}
        return outcomes

    def sample(self, logits: torch.Tensor, params: RowParams) -> SamplingResult:
        """Sample already-validated rows (used by every model that drives the sampler)."""
        rows = logits.shape[0]
        fresh = torch.randint(-(2**62), 2**62, (rows,), generator=self._entropy, dtype=torch.int64)
        seed = torch.where(torch.from_numpy(params.has_seed), torch.from_numpy(params.seed.view(np.int64)), fresh)
        on = lambda array, dtype: torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)  # noqa: E731
        batch = SamplingBatch(
            logits=logits.to(self.device),
            temperature=on(params.temperature, torch.float32),
            top_k=on(params.top_k, torch.int64),
            top_p=on(params.top_p, torch.float32),
            min_p=on(params.min_p, torch.float32),
            seed=seed.to(self.device),
            want_mask=on(params.return_sampling_mask, torch.bool),
        )
        return self.backend.sample(batch, self.policy.mask_width)


def outputs_to_numpy(result: SamplingResult) -> dict[str, np.ndarray]:
    """Sampler outputs by output name in the wire dtypes: [rows] scalars, [rows, W] mask."""
    host = lambda t, dtype: t.cpu().numpy().astype(dtype)  # noqa: E731
    return {
        "output_ids": host(result.token_ids, np.int32),
        "output_logprobs": host(result.logprobs, np.float32),
        "sampling_mask": host(result.mask_ids, np.int32),
        "sampling_mask_len": host(result.mask_len, np.int32),
        "sampling_logprobs": host(result.mask_logprobs, np.float32),
    }
