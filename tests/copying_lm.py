"""A test LM that repeats its context, with a cache that must be rolled back (tests only).

Next-token logits after a row's context are a fixed random row for its last token plus
`copy_bonus` on the token that followed the latest earlier occurrence of that last token: an
induction head. Its output repeats what it has seen, so prompt lookup drafts nearly every step
and most drafts are accepted, and its logits depend on the whole cached context, so a rollback
that leaves a rejected draft in the cache changes every later step. Each position's logits are
computed alike whatever pass computes them (prefill, one token, several), so speculative and
plain decoding are compared bit for bit.

`poison` maps a context length to "nan" (NaN on one other token) or "inf" (+inf on the copied
token): the logits after a context of that length are unusable, yet greedy sampling still
draws the copied token there.
"""

from __future__ import annotations

import numpy as np
import torch

VOCAB = 64


class CopyingLM:
    """The induction-head LM; its state is each row's cached tokens (its KV cache)."""

    TABLE = np.random.default_rng(11).normal(0, 1.5, (VOCAB, VOCAB)).astype(np.float32)

    def __init__(self, copy_bonus: float = 10.0, eos: tuple[int, ...] = (), poison: dict[int, str] | None = None):
        self.vocab_size, self.context_length, self.eos_token_ids = VOCAB, 512, tuple(eos)
        self.copy_bonus = np.float32(copy_bonus)
        self.poison = dict(poison or {})
        self.rolled_back = 0  # tokens forgotten by rollback, over the LM's life
        self.longest_context = 0  # the most tokens any row's logits were computed after

    def logits_after(self, context: list[int]) -> np.ndarray:
        """float32 [V]: the logits for the token after `context`."""
        self.longest_context = max(self.longest_context, len(context))
        last = context[-1]
        logits = self.TABLE[last].copy()
        earlier = np.flatnonzero(np.asarray(context[:-1]) == last)
        copied = context[earlier[-1] + 1] if earlier.size else None
        if copied is not None:
            logits[copied] += self.copy_bonus
        kind = self.poison.get(len(context))
        if kind == "nan":
            logits[(copied or 0) + 1 if (copied or 0) + 1 < VOCAB else 0] = np.nan
        elif kind == "inf":
            logits[copied if copied is not None else 0] = np.inf
        return logits

    def _stack(self, contexts: list[list[int]]) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.logits_after(c) for c in contexts]))

    def prefill(self, prompts):
        state = [[int(t) for t in prompt] for prompt in prompts]
        return self._stack(state), state

    def decode(self, state, tokens):
        for row, token in zip(state, tokens.tolist()):
            row.append(int(token))
        return self._stack(state)

    def decode_many(self, state, tokens, lengths):
        contexts = []
        for row, fed, length in zip(state, tokens.tolist(), lengths.tolist()):
            for token in fed[:length]:
                row.append(int(token))
                contexts.append(list(row))
        return self._stack(contexts)

    def rollback(self, state, counts):
        counts = counts.tolist()
        self.rolled_back += sum(counts)
        return [row[: len(row) - count] for row, count in zip(state, counts)]

    def keep(self, state, rows):
        return [state[i] for i in rows.tolist()]

    def merge(self, states):
        return [row for state in states for row in state]


def greedy_continuation(lm: CopyingLM, prompt: list[int], count: int) -> list[int]:
    """The first `count` tokens greedy decoding draws after `prompt` (argmax, lowest id on ties)."""
    context, tokens = list(prompt), []
    for _ in range(count):
        logits = lm.logits_after(context).astype(np.float64)
        token = int(np.argmax(np.where(np.isnan(logits), -np.inf, logits)))
        tokens.append(token)
        context.append(token)
    return tokens
