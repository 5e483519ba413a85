"""AReaL 1.0.4's RemoteSGLangEngine against the front door, as its FSDP trainer drives it: greedy rollouts
(tokens and log-probs it trains on, with `"image_data": []` and top_k 1e8 as it sends them) and weight
syncs over gloo (init_weights_update_group with the port as a string, the batched
update_weights_from_distributed, pause/continue around each), with no header: the trainer's
network is trusted (TRITON_API_TRUSTED_NETWORKS)."""

from __future__ import annotations

from .conftest import run_driver
from .reference import assert_same_tokens, generate
from .weights import free_port, weight_files  # noqa: F401 - fixture

PROMPT = [17, 301, 42, 9, 555]
MAX_NEW_TOKENS = 5


def door_address(stack) -> str:
    return f"127.0.0.1:{stack.ports['api']}"


def test_rollout_gets_greedy_tokens_and_logprobs(stack, api_url):
    result = run_driver("areal_remote", address=door_address(stack), prompt=PROMPT, max_new_tokens=MAX_NEW_TOKENS)
    assert "error" not in result, result.get("traceback", result)
    before = result["before"]
    assert before["stop_reason"] in ("length", "stop")
    expected = generate(api_url, PROMPT, MAX_NEW_TOKENS, 0, temperature=0.0)
    assert_same_tokens(before["tokens"], before["logprobs"], expected)


def test_weight_sync_over_gloo_changes_and_restores_the_rollouts(stack, weight_files):  # noqa: F811
    result = run_driver(
        "areal_remote",
        address=door_address(stack),
        prompt=PROMPT,
        max_new_tokens=MAX_NEW_TOKENS,
        sync=True,
        master_port=free_port(),
        **weight_files,
    )
    assert "error" not in result, result.get("traceback", result)
    assert result["moved"]["tokens"] != result["before"]["tokens"], "the moved weights changed nothing"
    assert result["restored"]["tokens"] == result["before"]["tokens"], "the original weights did not come back"
