"""A sequence's timings as the API answers them, from the generate model's per-request outputs
(docs/metrics.md#per-request-timings): `queue_time_s` (submission to admission into the running
batch), `time_to_first_token_s` (submission to the first token) and `generation_time_s`
(admission to the last token), seconds on the engine's clock, plus what they imply: the engine's
end to end (queue + generation), the mean inter-token latency ((end to end - TTFT) / (n - 1)) and
tokens per second (n / generation), for n completion tokens.

OpenAI's dialect has no such field (vLLM keeps its per-request metrics off the wire): they go in a
`timings` object per choice, named with their units. SGLang's meta_info reuses SGLang's own keys
where the meaning is the same (`queue_time`, `inference_time`: the forward entry to the finish)
and adds the others in its style (no unit suffix, seconds).
"""

from __future__ import annotations

from ..client.generate_client import RequestTimings


def openai_timings(timings: RequestTimings | None, completion_tokens: int) -> dict | None:
    """A choice's `timings` object; None when the generate model sent none (a sequence a stop
    string ended is cancelled before its last response)."""
    if timings is None:
        return None
    queue, ttft, generation = timings.queue_s, timings.time_to_first_token_s, timings.generation_s
    end_to_end = queue + generation
    return {
        "queue_time_s": queue,
        "time_to_first_token_s": ttft,
        "generation_time_s": generation,
        "e2e_latency_s": end_to_end,
        "mean_inter_token_latency_s": (end_to_end - ttft) / (completion_tokens - 1) if completion_tokens > 1 else None,
        "tokens_per_s": completion_tokens / generation if generation > 0 else None,
    }


def sglang_timings(timings: RequestTimings | None, completion_tokens: int) -> dict:
    """The same figures as meta_info keys (empty when there are none)."""
    figures = openai_timings(timings, completion_tokens)
    if figures is None:
        return {}
    return {
        "queue_time": figures["queue_time_s"],
        "inference_time": figures["generation_time_s"],
        "time_to_first_token": figures["time_to_first_token_s"],
        "mean_inter_token_latency": figures["mean_inter_token_latency_s"],
        "tokens_per_second": figures["tokens_per_s"],
    }
