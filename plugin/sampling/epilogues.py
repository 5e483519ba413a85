"""Epilogues: from ranked candidates and a normaliser to each row's outputs.

Each applies the prefix rules (top_k, -inf, top_p, min_p), draws the token by Gumbel-max with the
row's counter-based noise (`rng`) and builds the outputs by wire name (`results.FIELDS`). The
rows' `params` are as the sampler applies them (`RowParams.greedy_applied`, every seed resolved)
and `k_eff` is their effective top_k (`params.effective_top_k`).

Both boundary rules are inclusive and decided alike on every path (these and `fused`):
top_p keeps a token while the mass ranked strictly before it is <= top_p, compared unnormalised,
sum_before(p / p_max) <= top_p * z in float64, so logits tied at the max (each adding exactly 1)
meet an exactly representable top_p exactly; min_p keeps x - max >= `params.min_p_bound`, the
exact float64 difference against the one bound the host computes.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import outputs, rng
from .params import RowParams, min_p_bound
from .results import ROW_MAX


def epilogue_numpy(
    values32: np.ndarray, ids: np.ndarray, z: np.ndarray, params: RowParams, k_eff: np.ndarray, mask_width: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The outputs of [rows, k] ranked candidates (float32 values, int64 ids, float32 normalisers
    z = sum exp((x - max) / T)) in float64 numpy, and the rows' support lengths.

    On the CPU a numpy call costs a fraction of a torch op's dispatch, yet it is most of the
    epilogue's cost at B=1, so calls are counted: the support length is the least of the rules'
    prefix lengths (a rule no row uses is skipped), work past the longest support is skipped, and
    the masks are written straight into their padded [rows, mask_width] arrays.
    """
    count, k = values32.shape
    if count == 1:
        one_row = _epilogue_one_row(values32[0], ids[0], z[0], params, int(k_eff[0]), mask_width)
        if one_row is not None:
            return one_row
    want_mask = params.return_sampling_mask
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # NaN / inf rows: refused later
        # x - max in float64: exact for the float32 operands (widened exactly).
        scaled = np.subtract(values32, values32[:, :1], dtype=np.float64)
        support_len = np.minimum(k_eff, k)
        if values32[:, -1].min() == -np.inf:  # banned tokens among the candidates
            support_len = np.minimum(support_len, (values32 > -np.inf).sum(axis=1))
        if params.min_p.max() > 0:
            support_len = np.minimum(support_len, (scaled >= min_p_bound(params)[:, None]).sum(axis=1))
        scaled /= params.temperature[:, None]  # (x - max) / T
        relative = np.exp(scaled)  # p / p_max
        if params.top_p.min() < 1:  # the mass ranked strictly before a token must not pass top_p
            mass_before = np.cumsum(relative, axis=1)
            mass_before -= relative
            bound = params.top_p * z.astype(np.float64)  # top_p * z: exact in float64
            if params.top_p.max() >= 1:  # top_p >= 1 disables the rule in its rows
                bound[params.top_p >= 1] = np.inf
            support_len = np.minimum(support_len, (mass_before <= bound[:, None]).sum(axis=1))
        # Past the longest support nothing can be drawn or returned: the rest of the work stops there.
        longest = max(1, int(support_len.max()))
        scaled, relative, ids = scaled[:, :longest], relative[:, :longest], ids[:, :longest]
        keep = np.arange(longest) < support_len[:, None]
        # Gumbel-max: scaled - log(-log u) is scaled + Gumbel noise, bit for bit.
        score = np.subtract(scaled, rng.negated_gumbel_numpy(rng.seed_state_numpy(params.seed)[:, None], ids))
        at = np.arange(count), np.where(keep, score, -np.inf).argmax(axis=1)
        token_scaled = scaled[at]
        # log of the support's mass relative to p_max: a singleton's renormalised log-prob is 0 exactly.
        support_log_mass = np.log(np.where(keep, relative, 0.0).sum(axis=1))
        mask_len = np.where(want_mask, np.minimum(support_len, mask_width), 0)
        width = min(longest, mask_width)
        in_mask = keep[:, :width] & want_mask[:, None]
        # Outside the mask the padding stays: -1 ids, -inf log-probs, 0 where no mask was asked.
        mask_ids = _filled((count, mask_width), -1, np.int32)
        np.copyto(mask_ids[:, :width], ids[:, :width], casting="same_kind", where=in_mask)
        support_logprobs = _filled((count, mask_width), -np.inf, np.float32)
        np.subtract(
            scaled[:, :width],
            support_log_mass[:, None],
            out=support_logprobs[:, :width],
            where=in_mask,
            casting="same_kind",
        )
        mask_logprobs = np.zeros(count, np.float32)
        np.subtract(token_scaled, support_log_mass, out=mask_logprobs, where=want_mask, casting="same_kind")
    fields = {
        outputs.OUTPUT_IDS.name: ids[at],
        outputs.OUTPUT_LOGPROBS.name: (token_scaled - np.log(z, dtype=np.float64)).astype(np.float32),
        outputs.SAMPLING_MASK.name: mask_ids,
        outputs.SAMPLING_MASK_LEN.name: mask_len.astype(np.int32),
        outputs.SAMPLING_LOGPROBS.name: mask_logprobs,
        outputs.SAMPLING_MASK_LOGPROBS.name: support_logprobs,
        ROW_MAX: values32[:, 0].copy(),
    }
    return fields, support_len


# Below this, a (x - max) / T may leave float32's range once the log-normaliser (at most
# log(V) < 32) is subtracted: the general epilogue casts such log-probs to -inf with the warnings off.
_FLOAT32_SAFE = -1e38


def _epilogue_one_row(
    values32: np.ndarray, ids: np.ndarray, z: np.float32, params: RowParams, k_eff: int, mask_width: int
) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
    """`epilogue_numpy` of a batch of one row, bit for bit, in about half its numpy calls: the row's
    parameters as scalars, and no keep mask (one row's support is the prefix its candidates are
    cut to). The same numpy operations run on the same values, so every output has the same bits.

    None where the batch's code must run: a row with no finite max or an empty support (refused
    later), or log-probs past float32's range. Elsewhere no operation here can overflow, divide
    by zero or meet an invalid operand, so numpy's error state is left alone (setting it costs
    more than the rest of this function's calls together)."""
    row_max = values32[0]
    if not -np.inf < row_max < np.inf:
        return None
    k = values32.size
    temperature, top_p = params.temperature[0], params.top_p[0]
    # x - max in float64: exact for the float32 operands (widened exactly).
    scaled = np.subtract(values32, row_max, dtype=np.float64)
    support_len = min(k_eff, k)
    if values32[-1] == -np.inf:  # banned tokens among the candidates
        support_len = min(support_len, np.count_nonzero(values32 > -np.inf))
    if params.min_p[0] > 0:
        support_len = min(support_len, np.count_nonzero(scaled >= min_p_bound(params)[0]))
    scaled /= temperature  # (x - max) / T
    relative = np.exp(scaled)  # p / p_max
    if top_p < 1:  # the mass ranked strictly before a token must not pass top_p
        mass_before = relative.cumsum()
        mass_before -= relative
        support_len = min(support_len, np.count_nonzero(mass_before <= top_p * np.float64(z)))  # exact in float64
    if support_len < 1 or scaled[support_len - 1] < _FLOAT32_SAFE:
        return None
    scaled, relative, ids = scaled[:support_len], relative[:support_len], ids[:support_len]
    # Gumbel-max: scaled - log(-log u) is scaled + Gumbel noise, bit for bit.
    score = np.subtract(scaled, rng.negated_gumbel_numpy(rng.seed_state_numpy(params.seed), ids))
    pick = int(score.argmax())
    token_scaled = scaled[pick]
    # log of the support's mass relative to p_max: a singleton's renormalised log-prob is 0 exactly.
    support_log_mass = np.log(relative.sum())
    mask_ids, support_logprobs = (padding.copy() for padding in _one_row_padding(mask_width))
    mask_len, mask_logprob = 0, 0.0
    if params.return_sampling_mask[0]:
        mask_len = min(support_len, mask_width)
        mask_ids[0, :mask_len] = ids[:mask_len]
        np.subtract(scaled[:mask_len], support_log_mass, out=support_logprobs[0, :mask_len], casting="same_kind")
        mask_logprob = token_scaled - support_log_mass
    fields = {
        outputs.OUTPUT_IDS.name: ids[pick : pick + 1].copy(),
        outputs.OUTPUT_LOGPROBS.name: np.array([token_scaled - np.log(z, dtype=np.float64)], np.float32),
        outputs.SAMPLING_MASK.name: mask_ids,
        outputs.SAMPLING_MASK_LEN.name: np.array([mask_len], np.int32),
        outputs.SAMPLING_LOGPROBS.name: np.array([mask_logprob], np.float32),
        outputs.SAMPLING_MASK_LOGPROBS.name: support_logprobs,
        ROW_MAX: values32[:1].copy(),
    }
    return fields, np.array([support_len], np.int64)


@functools.lru_cache(maxsize=8)
def _one_row_padding(mask_width: int) -> tuple[np.ndarray, np.ndarray]:
    """A one-row batch's padded mask ids and mask log-probs [1, mask_width], to copy (read-only)."""
    ids, logprobs = _filled((1, mask_width), -1, np.int32), _filled((1, mask_width), -np.inf, np.float32)
    ids.flags.writeable = logprobs.flags.writeable = False
    return ids, logprobs


def _filled(shape: tuple[int, int], value, dtype) -> np.ndarray:
    """np.full in two C calls (np.full itself runs Python code around them)."""
    array = np.empty(shape, dtype)
    array.fill(value)
    return array


def epilogue_torch(
    values: torch.Tensor, ids: torch.Tensor, z: torch.Tensor, params: RowParams, k_eff: np.ndarray, mask_width: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`epilogue_numpy` in torch on the candidates' device (the GPU rows the fused kernels do not
    take), from float64 normalisers z = sum exp((x - max) / T)."""
    device = values.device
    on = lambda array: torch.from_numpy(np.ascontiguousarray(array)).to(device)  # noqa: E731
    count, k = values.shape
    difference = values.to(torch.float64) - values[:, :1].to(torch.float64)  # x - max, exact
    scaled = difference / on(params.temperature).to(torch.float64).unsqueeze(1)
    logp = scaled - z.log().unsqueeze(1)
    relative = scaled.exp()  # p / p_max
    rank = torch.arange(k, device=device).unsqueeze(0)
    keep = (rank < on(k_eff).unsqueeze(1)) & (values > float("-inf"))
    top_p = on(params.top_p).to(torch.float64).unsqueeze(1)
    keep &= (top_p >= 1) | (torch.cumsum(relative, dim=-1) - relative <= top_p * z.unsqueeze(1))
    keep &= difference >= on(min_p_bound(params)).unsqueeze(1)
    support_len = keep.sum(dim=-1)
    noise = rng.gumbel(rng.seed_state(on(params.seed.view(np.int64))).unsqueeze(1), ids)
    minus_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=device)
    pick = torch.where(keep, scaled + noise, minus_inf).argmax(dim=-1, keepdim=True)
    token_logp = logp.gather(1, pick).squeeze(1)
    support_logmass = torch.logsumexp(torch.where(keep, logp, minus_inf), dim=-1)
    want = on(params.return_sampling_mask)
    width = min(k, mask_width)
    mask_len = torch.where(want, support_len.clamp(max=mask_width), torch.zeros_like(support_len))
    in_mask = rank[:, :width] < mask_len.unsqueeze(1)
    fields = {
        outputs.OUTPUT_IDS.name: ids.gather(1, pick).squeeze(1),
        outputs.OUTPUT_LOGPROBS.name: token_logp,
        outputs.SAMPLING_MASK.name: torch.where(in_mask, ids[:, :width], torch.full_like(ids[:, :width], -1)),
        outputs.SAMPLING_MASK_LEN.name: mask_len,
        outputs.SAMPLING_LOGPROBS.name: torch.where(want, token_logp - support_logmass, torch.zeros_like(token_logp)),
        outputs.SAMPLING_MASK_LOGPROBS.name: torch.where(
            in_mask, logp[:, :width] - support_logmass.unsqueeze(1), minus_inf
        ),
        ROW_MAX: values[:, 0].float(),  # bf16 logits: float32 like every path's row max
    }
    return fields, support_len


def unranked_outputs(logits: torch.Tensor, params: RowParams) -> dict[str, torch.Tensor]:
    """The outputs of rows with no top_k, top_p >= 1 and no mask: Gumbel-max over the whole
    vocabulary in float64, with no ranking at all (the mask fields are zero columns wide)."""
    device = logits.device
    rows = logits.shape[0]
    row_max = logits.amax(dim=-1)
    temperature = torch.from_numpy(params.temperature).to(device, torch.float64).unsqueeze(1)
    difference = logits.to(torch.float64) - row_max.to(torch.float64).unsqueeze(1)  # x - max, exact
    scaled = difference / temperature
    log_z = torch.logsumexp(scaled, dim=-1)
    min_p = torch.from_numpy(min_p_bound(params)).to(device).unsqueeze(1)
    keep = (logits > float("-inf")) & (difference >= min_p)
    vocab_ids = torch.arange(logits.shape[1], device=device).unsqueeze(0)
    noise = rng.gumbel(rng.seed_state(torch.from_numpy(params.seed.view(np.int64)).to(device)).unsqueeze(1), vocab_ids)
    score = torch.where(keep, scaled + noise, torch.tensor(float("-inf"), dtype=torch.float64, device=device))
    pick = score.argmax(dim=-1, keepdim=True)
    return {
        outputs.OUTPUT_IDS.name: pick.squeeze(1),
        outputs.OUTPUT_LOGPROBS.name: scaled.gather(1, pick).squeeze(1) - log_z,
        outputs.SAMPLING_MASK.name: torch.full((rows, 0), -1, dtype=torch.int32),
        outputs.SAMPLING_MASK_LEN.name: torch.zeros(rows, dtype=torch.int32),
        outputs.SAMPLING_LOGPROBS.name: torch.zeros(rows, dtype=torch.float32),
        outputs.SAMPLING_MASK_LOGPROBS.name: torch.full((rows, 0), float("-inf")),
        ROW_MAX: row_max.float(),  # bf16 logits: numpy has no bfloat16
    }
