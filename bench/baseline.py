"""The comparison point: SGLang's torch-native full-sort sampling path, plus a mask read-out.

Written from its published description (softmax -> sort descending -> cumsum -> zero what top-k,
top-p and min-p exclude -> multinomial), not copied. It ranks the whole vocabulary with one full
sort per row, which is what a user without a top-k-aware sampler runs today.
"""

from __future__ import annotations

import torch


def full_sort_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    mask_width: int,
    want_mask: bool,
) -> dict[str, torch.Tensor]:
    """Token ids and log-probs per row; with `want_mask`, the support ids (padded -1), its length
    and the token's log-prob renormalised over it. Shapes: logits [B, V], parameters [B]."""
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    mass_before = torch.cumsum(probs_sort, dim=-1) - probs_sort
    rank = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    probs_sort[rank >= top_k.unsqueeze(1)] = 0.0
    probs_sort[mass_before > top_p.unsqueeze(1)] = 0.0
    if bool((min_p > 0).any()):  # SGLang applies min-p only when some row asks for it
        probs_sort[probs_sort < (probs_sort[:, :1] * min_p.unsqueeze(1))] = 0.0
    pick = torch.multinomial(probs_sort, num_samples=1)
    token_ids = probs_idx.gather(1, pick).squeeze(1)
    token_p = probs_sort.gather(1, pick).squeeze(1)
    out = {"token_ids": token_ids, "logprobs": token_p.log()}
    if want_mask:
        # The support is the non-zero prefix of probs_sort; read its first W ids out.
        head = probs_sort[:, :mask_width]
        in_support = head > 0
        out["mask_ids"] = torch.where(
            in_support, probs_idx[:, :mask_width], torch.full_like(probs_idx[:, :mask_width], -1)
        )
        out["mask_len"] = in_support.sum(dim=-1)
        out["mask_logprobs"] = (token_p / head.sum(dim=-1)).log()
    return out


def floor(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The least work the math needs with a finite top_k: one top-k selection, one log-sum-exp."""
    return torch.topk(logits, k, dim=-1), torch.logsumexp(logits, dim=-1)


def vllm_style_sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Token ids only: a torch top-k/top-p sampler in the manner vLLM documents for its native path.

    Written from the description (temperature, then one ascending sort of the row; top-k masks
    everything below the k-th largest value; top-p masks the low tail whose cumulative probability
    stays within 1 - top_p, always keeping the largest; scatter back; softmax; an exponential race
    `argmax(probs / q)`, q ~ Exp(1)), not copied. `top_k` None / `top_p` None skip that filter.
    No log-probs and no mask: the cheapest form of the full-sort approach.
    """
    scaled = logits / temperature.unsqueeze(1)
    if top_k is None and top_p is None:
        ranked = scaled
    else:
        ranked, order = scaled.sort(dim=-1, descending=False)
        vocab = ranked.shape[-1]
        if top_k is not None:
            kth = ranked.gather(1, (vocab - top_k.clamp(1, vocab)).long().unsqueeze(1))
            ranked.masked_fill_(ranked < kth, float("-inf"))
        if top_p is not None:
            tail_mass = ranked.softmax(dim=-1).cumsum(dim=-1)
            drop = tail_mass <= (1 - top_p).unsqueeze(1)
            drop[:, -1] = False  # the most probable token always stays
            ranked.masked_fill_(drop, float("-inf"))
        ranked = torch.empty_like(ranked).scatter_(1, order, ranked)
    probs = ranked.softmax(dim=-1)
    race = torch.empty_like(probs).exponential_()
    return probs.div_(race).argmax(dim=-1)


_FLASHINFER_PROBE = """
import torch, flashinfer.sampling as s
x = torch.randn(2, 32000, device='{device}')
k = torch.full((2,), 50, dtype=torch.int32, device=x.device)
p = torch.full((2,), 0.95, dtype=torch.float32, device=x.device)
ids = s.top_k_top_p_sampling_from_logits(x, k, p)
torch.cuda.synchronize()
assert ids.shape[0] == 2, ids.shape
"""


def flashinfer_sampler(device: torch.device, probe_timeout_s: float = 90.0):
    """FlashInfer's fused `flashinfer.sampling.top_k_top_p_sampling_from_logits(logits, top_k,
    top_p)` (rejection sampling, no sort; temperature applied by dividing the logits first, as vLLM
    does before calling it), or None and the reason it is skipped.

    One call is made first in a subprocess under a timeout: FlashInfer may JIT-compile its kernels
    on first use (minutes with nvcc), which must not eat the benchmark's budget; a compile that
    finishes there is cached for this process.
    """
    import subprocess
    import sys

    if device.type != "cuda":
        return None, f"FlashInfer runs on CUDA only (device is {device})"
    try:
        import flashinfer
        import flashinfer.sampling
    except Exception as error:  # noqa: BLE001 - any import failure means: skip it
        return None, f"import flashinfer failed: {error!r}"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _FLASHINFER_PROBE.format(device=device)],
            capture_output=True,
            text=True,
            timeout=probe_timeout_s,
        )
    except subprocess.TimeoutExpired:
        return None, f"flashinfer {flashinfer.__version__}: first call took over {probe_timeout_s:.0f} s (JIT compile?)"
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"flashinfer {flashinfer.__version__}: probe call failed: {tail[0]}"
    fn = flashinfer.sampling.top_k_top_p_sampling_from_logits

    def call(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
        """top_k int32 [B], top_p float32 [B], on the logits' device."""
        return fn(logits / temperature.unsqueeze(1), top_k, top_p)

    return call, f"flashinfer {flashinfer.__version__}"
