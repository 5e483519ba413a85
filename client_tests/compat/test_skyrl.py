"""skyrl-train 0.3.1's RemoteInferenceEngine (SGLang backend) against the front door, as its trainer
drives it: a batched /generate with its generator's sampling params (token ids, no log-probs on this
path: skyrl-train asks none from SGLang), then its broadcast weight sync over gloo (one tensor per
update_weights_from_distributed, flush_cache beside it), sleep / wake_up and the teardown.
skyrl-train checks no status, so the test reads each answer it got."""

from __future__ import annotations

from .conftest import run_driver
from .reference import generate
from .weights import free_port, weight_files  # noqa: F401 - fixture
from .wire import get

PROMPTS = [[17, 301, 42, 9, 555], [4, 8, 15, 16, 23, 42]]
MAX_NEW_TOKENS = 5


def model_name(api_url: str) -> str:
    return get(f"{api_url}/v1/models")[1]["data"][0]["id"]


def succeeded(answer) -> bool:
    return isinstance(answer, dict) and answer.get("success") is True


def test_batched_rollout_gets_token_ids(stack, api_url):
    result = run_driver(
        "skyrl_remote",
        address=f"127.0.0.1:{stack.ports['api']}",
        model=model_name(api_url),
        prompts=PROMPTS,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    assert "error" not in result, result.get("traceback", result)
    for rollout in (result["sampled"], result["before"]):
        assert len(rollout["response_ids"]) == len(PROMPTS)
        assert all(1 <= len(ids) <= MAX_NEW_TOKENS for ids in rollout["response_ids"])
        assert all(reason in ("length", "stop") for reason in rollout["stop_reasons"])
    for prompt, ids in zip(PROMPTS, result["before"]["response_ids"]):
        assert ids == generate(api_url, prompt, MAX_NEW_TOKENS, 0, temperature=0.0)["ids"][: len(ids)]


def test_broadcast_weight_sync_over_gloo(stack, api_url, weight_files):  # noqa: F811
    result = run_driver(
        "skyrl_remote",
        address=f"127.0.0.1:{stack.ports['api']}",
        model=model_name(api_url),
        prompts=PROMPTS,
        max_new_tokens=MAX_NEW_TOKENS,
        sync=True,
        master_port=free_port(),
        **weight_files,
    )
    assert "error" not in result, result.get("traceback", result)
    assert succeeded(result["init"]), result["init"]
    for step in ("moved", "restored"):
        answers = result[f"sync_{step}"]
        assert all(succeeded(answer) for answer in answers["updates"]), answers["updates"][:2]
        assert isinstance(answers["reset_prefix_cache"], dict), answers["reset_prefix_cache"]
    for call in ("sleep", "wake_up_weights", "wake_up_kv_cache", "teardown"):
        assert succeeded(result[call]), (call, result[call])
    assert result["moved"]["response_ids"] != result["before"]["response_ids"], "the moved weights changed nothing"
    assert result["restored"]["response_ids"] == result["before"]["response_ids"]
