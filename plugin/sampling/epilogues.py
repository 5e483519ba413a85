"""Epilogues: the prefix rules, the seeded draw and the outputs over ranked candidates."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from . import rng

if TYPE_CHECKING:
    from .sampler import _RowParams


def _epilogue_numpy(values32: np.ndarray, ids: np.ndarray, z: np.ndarray, rows: _RowParams, mask_width: int) -> dict:
    """The prefix rules, the seeded draw and the outputs over [rows, k] ranked candidates (float32
    values, int64 ids, float32 normalisers z = sum exp((x - max) / T)), in float64 numpy: on CPU a
    numpy op costs a fraction of a torch op's dispatch, and these arrays are small. Even so each
    call costs about a microsecond, most of the epilogue at B=1, so calls are counted: each rule
    keeps a prefix of the ranking, so the support length is the least of the rules' prefix
    lengths (a rule no row uses is skipped), work past the longest support is skipped, and the
    masks are written straight into their padded [rows, mask_width] arrays."""
    count, k = values32.shape
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # NaN / inf rows: refused later
        # (x - max) / T in float64; the float32 operands are widened exactly.
        scaled = np.subtract(values32, values32[:, :1], dtype=np.float64)
        scaled /= rows.temperature[:, None]
        relative = np.exp(scaled)  # p / p_max
        support_len = np.minimum(rows.k_eff, k)
        if values32[:, -1].min() == -np.inf:  # banned tokens among the candidates
            support_len = np.minimum(support_len, (values32 > -np.inf).sum(axis=1))
        if rows.top_p.min() < 1:  # the mass ranked strictly before a token must not pass top_p
            probs = relative / z[:, None]  # z widens to float64 exactly
            mass_before = np.cumsum(probs, axis=1)
            mass_before -= probs
            top_p = rows.top_p
            if top_p.max() >= 1:  # top_p >= 1 disables the rule in its rows
                top_p = np.where(top_p >= 1, np.inf, top_p)
            support_len = np.minimum(support_len, (mass_before <= top_p[:, None]).sum(axis=1))
        if rows.min_p.max() > 0:
            support_len = np.minimum(support_len, (relative >= rows.min_p[:, None]).sum(axis=1))
        # Past the longest support nothing can be drawn or returned: the rest of the work stops there.
        longest = max(1, int(support_len.max()))
        scaled, relative, ids = scaled[:, :longest], relative[:, :longest], ids[:, :longest]
        keep = np.arange(longest) < support_len[:, None]
        # Gumbel-max: scaled - log(-log u) is scaled + Gumbel noise, bit for bit.
        score = np.subtract(scaled, rng.negated_gumbel_numpy(rng.seed_state_numpy(rows.seed)[:, None], ids))
        at = np.arange(count), np.where(keep, score, -np.inf).argmax(axis=1)
        token_scaled = scaled[at]
        # log of the support's mass relative to p_max: a singleton's renormalised log-prob is 0 exactly.
        support_log_mass = np.log(np.where(keep, relative, 0.0).sum(axis=1))
        mask_len = np.where(rows.want_mask, np.minimum(support_len, mask_width), 0)
        width = min(longest, mask_width)
        in_mask = keep[:, :width] & rows.want_mask[:, None]
        # Outside the mask the padding stays: -1 ids, -inf log-probs, 0 where no mask was asked.
        mask_ids = np.full((count, mask_width), -1, np.int32)
        np.copyto(mask_ids[:, :width], ids[:, :width], casting="same_kind", where=in_mask)
        support_logprobs = np.full((count, mask_width), -np.inf, np.float32)
        np.subtract(
            scaled[:, :width],
            support_log_mass[:, None],
            out=support_logprobs[:, :width],
            where=in_mask,
            casting="same_kind",
        )
        mask_logprobs = np.zeros(count, np.float32)
        np.subtract(token_scaled, support_log_mass, out=mask_logprobs, where=rows.want_mask, casting="same_kind")
    return {
        "output_ids": ids[at],
        "output_logprobs": (token_scaled - np.log(z, dtype=np.float64)).astype(np.float32),
        "sampling_mask": mask_ids,
        "sampling_mask_len": mask_len.astype(np.int32),
        "sampling_logprobs": mask_logprobs,
        "sampling_mask_logprobs": support_logprobs,
        "row_max": values32[:, 0].copy(),
        "support_len": support_len,
    }


def _epilogue_torch(
    values: torch.Tensor, ids: torch.Tensor, log_z: torch.Tensor, rows: _RowParams, mask_width: int
) -> dict:
    """`_epilogue_numpy` in torch on the logits' device (GPU rows the fused kernels do not take)."""
    device = values.device
    on = lambda array: torch.from_numpy(np.ascontiguousarray(array)).to(device)  # noqa: E731
    count, k = values.shape
    scaled = (values.to(torch.float64) - values[:, :1].to(torch.float64)) / on(rows.temperature).to(
        torch.float64
    ).unsqueeze(1)
    logp = scaled - log_z.unsqueeze(1)
    probs = logp.exp()
    rank = torch.arange(k, device=device).unsqueeze(0)
    keep = (rank < on(rows.k_eff).unsqueeze(1)) & (values > float("-inf"))
    top_p = on(rows.top_p).to(torch.float64).unsqueeze(1)
    keep &= (top_p >= 1) | (torch.cumsum(probs, dim=-1) - probs <= top_p)
    keep &= scaled.exp() >= on(rows.min_p).to(torch.float64).unsqueeze(1)
    support_len = keep.sum(dim=-1)
    noise = rng.gumbel(rng.seed_state(on(rows.seed)).unsqueeze(1), ids)
    minus_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=device)
    pick = torch.where(keep, scaled + noise, minus_inf).argmax(dim=-1, keepdim=True)
    token_logp = logp.gather(1, pick).squeeze(1)
    support_logmass = torch.logsumexp(torch.where(keep, logp, minus_inf), dim=-1)
    want = on(rows.want_mask)
    width = min(k, mask_width)
    mask_len = torch.where(want, support_len.clamp(max=mask_width), torch.zeros_like(support_len))
    in_mask = rank[:, :width] < mask_len.unsqueeze(1)
    return {
        "output_ids": ids.gather(1, pick).squeeze(1),
        "output_logprobs": token_logp,
        "sampling_mask": torch.where(in_mask, ids[:, :width], torch.full_like(ids[:, :width], -1)),
        "sampling_mask_len": mask_len,
        "sampling_logprobs": torch.where(want, token_logp - support_logmass, torch.zeros_like(token_logp)),
        "sampling_mask_logprobs": torch.where(in_mask, logp[:, :width] - support_logmass.unsqueeze(1), minus_inf),
        "row_max": values[:, 0],
        "support_len": support_len,
    }
