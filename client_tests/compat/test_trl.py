"""TRL 1.16's VLLMClient.generate and .chat through the front door: the ids it trains on and the
sampled token's log-prob, parsed by TRL's own parse_logprobs ("token_id:N" tokens, top_logprobs lists)."""

from __future__ import annotations

from .conftest import run_driver
from .reference import assert_same_tokens, generate

PROMPT = [17, 301, 42, 9, 555]
SEED = 31
MAX_TOKENS = 5


def sampled(logprobs, logprob_token_ids, completion_ids):
    """The sampled token's log-prob per position (logprobs=0: the sampled token alone)."""
    assert [ids[0] for ids in logprob_token_ids] == list(completion_ids)
    return [values[0] for values in logprobs]


def test_generate_and_chat_get_ids_and_logprobs(api_url):
    result = run_driver("trl_vllm", url=api_url, prompts=[PROMPT], max_tokens=MAX_TOKENS, seed=SEED)
    assert "error" not in result, result.get("traceback", result)
    completions = result["completions"]
    assert completions["prompt_ids"] == [PROMPT]
    ids = completions["completion_ids"][0]
    logprobs = sampled(completions["logprobs"][0], completions["logprob_token_ids"][0], ids)
    assert_same_tokens(ids, logprobs, generate(api_url, PROMPT, MAX_TOKENS, SEED, temperature=1.0))
    chat = result["chat"]
    prompt_ids, ids = chat["prompt_ids"][0], chat["completion_ids"][0]
    logprobs = sampled(chat["logprobs"][0], chat["logprob_token_ids"][0], ids)
    assert_same_tokens(ids, logprobs, generate(api_url, prompt_ids, MAX_TOKENS, SEED, temperature=1.0))
