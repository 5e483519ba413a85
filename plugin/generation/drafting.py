"""Draft tokens for speculative decoding: prompt lookup ("ngram"), vectorised over the batch.

A drafter only proposes; the engine verifies every drafted token by sampling, from the target
LM's logits at its position and with that position's step seed, the token plain decoding would
draw there, and keeps the draft only up to the first disagreement. So what a drafter proposes
changes the speed, never the tokens: every algorithm named here is exact.

Prompt lookup (vLLM's "ngram", also known as prompt-lookup decoding): find the row's last n
tokens earlier in its sequence (prompt and generated tokens), n from `max_n` down to `min_n`,
the latest occurrence first, and propose the tokens that followed it. When the occurrence is
closer than the draft is long, the proposal repeats with that period (a loop keeps looping).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..sampling.validation import NGRAM, SPECULATIVE_ALGORITHMS

__all__ = ["NGRAM", "PAD", "SPECULATIVE_ALGORITHMS", "NgramDrafter", "TokenHistory"]

PAD = -1  # no token: history past a row's length, drafts past a row's count


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt-lookup drafting: up to `num_tokens` tokens per row after a matched n-gram."""

    num_tokens: int = 4
    max_n: int = 3
    # Matching 2 tokens at least: a single token recurs by chance in any long sequence, and a draft
    # rejected at once costs a wider forward pass and more sampled positions for nothing.
    min_n: int = 2
    # A step with this many rows in flight or more drafts nothing (0: always draft). A full batch
    # already uses the hardware that drafting would fill; where that is depends on the device.
    disable_at_rows: int = 0

    def __post_init__(self):
        if self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_tokens}")
        if self.disable_at_rows < 0:
            raise ValueError(f"speculative_disable_by_batch_size must be >= 0, got {self.disable_at_rows}")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"prompt_lookup_min ({self.min_n}) and prompt_lookup_max ({self.max_n}) must satisfy "
                "1 <= prompt_lookup_min <= prompt_lookup_max"
            )

    def drafts_for(self, rows: int) -> bool:
        """Whether a step with `rows` rows in flight drafts at all."""
        return not self.disable_at_rows or rows < self.disable_at_rows

    def propose(self, history: np.ndarray, lengths: np.ndarray, limits: np.ndarray) -> np.ndarray:
        """Drafts [rows, num_tokens] (PAD where none) for the sequences `history[i, :lengths[i]]`
        (int64 [rows, T], PAD beyond each length); row i gets at most `limits[i]` tokens."""
        rows, width = history.shape
        drafts = np.full((rows, self.num_tokens), PAD, np.int64)
        limits = np.minimum(limits, self.num_tokens)
        period = np.zeros(rows, np.int64)  # distance from the match to the row's end; 0: none
        # Every match ends on an earlier copy of the row's last token: find those (few, and mostly
        # none when the text does not repeat), then how far each agrees with the suffix backwards.
        last = history[np.arange(rows), np.maximum(lengths - 1, 0)]
        earlier = np.arange(width)[None, :] < (lengths - 1)[:, None]
        wanted = (limits > 0) & (lengths > self.min_n)  # a match of n needs n + 1 tokens at least
        row, end = np.nonzero((history == last[:, None]) & earlier & wanted[:, None])
        if row.size:
            suffix_end = lengths[row] - 1
            matched = np.ones(row.size, np.int64)  # tokens agreeing, ending at `end` and at the suffix's end
            for k in range(1, self.max_n):
                agree = (matched == k) & (end >= k) & (lengths[row] > k + 1)
                agree[agree] = history[row[agree], end[agree] - k] == history[row[agree], suffix_end[agree] - k]
                matched += agree
            keep = matched >= self.min_n
            row, end, matched = row[keep], end[keep], matched[keep]
            # The longest match wins, then the latest: sorted by row, length, position, the last of each row.
            order = np.lexsort((end, matched, row))
            best = order[np.r_[row[order][1:] != row[order][:-1], True]] if order.size else order
            period[row[best]] = lengths[row[best]] - 1 - end[best]
        drafted = np.flatnonzero(period > 0)
        if drafted.size:
            ends, cycle = lengths[drafted], period[drafted]
            index = ends[:, None] - cycle[:, None] + np.arange(self.num_tokens)[None, :] % cycle[:, None]
            tokens = np.take_along_axis(history[drafted], index, axis=1)
            tokens[np.arange(self.num_tokens)[None, :] >= limits[drafted, None]] = PAD
            drafts[drafted] = tokens
        return drafts


class TokenHistory:
    """Every active row's tokens so far (prompt, then generated), PAD-padded to one width: what
    the drafter looks in. Rows join, leave and grow with the engine's batch."""

    def __init__(self):
        self.tokens = np.full((0, 0), PAD, np.int64)
        self.lengths = np.zeros(0, np.int64)

    def join(self, prompts: list[np.ndarray], capacities: list[int]) -> None:
        """Append rows holding `prompts`, each with room for `capacities[i]` tokens in all."""
        width = max(self.tokens.shape[1], *capacities)
        added = np.full((len(prompts), width), PAD, np.int64)
        for row, prompt in zip(added, prompts):  # once per request, at admission
            row[: prompt.size] = prompt
        old = np.pad(self.tokens, ((0, 0), (0, width - self.tokens.shape[1])), constant_values=PAD)
        self.tokens = np.concatenate([old, added])
        self.lengths = np.concatenate([self.lengths, [p.size for p in prompts]]).astype(np.int64)

    def keep(self, rows: np.ndarray) -> None:
        """Only `rows` (an index or boolean array) stay, in order."""
        self.tokens, self.lengths = self.tokens[rows], self.lengths[rows]

    def append(self, tokens: np.ndarray, counts: np.ndarray) -> None:
        """Row i grows by its first `counts[i]` entries of `tokens` ([rows, n])."""
        row, column = np.nonzero(np.arange(tokens.shape[1])[None, :] < counts[:, None])
        self.tokens[row, self.lengths[row] + column] = tokens[row, column]
        self.lengths = self.lengths + counts
