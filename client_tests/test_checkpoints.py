"""Real checkpoints through `model_path`, on a tritonserver of its own: tiny randomly initialised
models of two architectures (Llama, Qwen2: biased q/k/v projections, another vocabulary and
context) written with `save_pretrained`, each served by a copy of the shipped generate model
whose `model_path` names its directory. Every mask row is checked against a float64 replay of
the same checkpoint (full forward passes, no cache) fed to the float64 numpy reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from testbed.checkpoints import random_model
from testbed.server import ExternalTritonServer, TritonServer, copy_model
from tests.lm_reference import step_logits
from triton_sampling_mask.client import GenerateClient, GenerateError
from triton_sampling_mask.client.sampling_params import SamplingParams

from .generate_client import assert_matches_reference

# Tiny sizes; a large initializer_range makes the next-token distributions peaked enough for
# top-p and min-p to matter.
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.35,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
ARCHITECTURES = {
    "llama": ("LlamaConfig", dict(SHAPE, vocab_size=512, max_position_embeddings=256), 1),
    "qwen2": ("Qwen2Config", dict(SHAPE, vocab_size=320, max_position_embeddings=192), 2),
}
RULES = dict(temperature=0.8, top_k=16, top_p=0.9, min_p=0.02)


def write_checkpoint(kind: str, dest) -> None:
    """A randomly initialised float32 model of `kind`, saved as a Hugging Face directory."""
    import transformers

    config_class, settings, seed = ARCHITECTURES[kind]
    random_model(getattr(transformers, config_class)(**settings), seed).save_pretrained(dest)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{architecture: its checkpoint directory}."""
    root = tmp_path_factory.mktemp("checkpoints")
    for kind in ARCHITECTURES:
        write_checkpoint(kind, root / kind)
    return {kind: root / kind for kind in ARCHITECTURES}


@pytest.fixture(scope="module")
def checkpoint_server(tmp_path_factory, checkpoints):
    if ExternalTritonServer.from_environment() is not None:
        pytest.skip("starts a local CPU tritonserver serving checkpoints written by the test")
    repository = tmp_path_factory.mktemp("checkpoint_models")
    for kind, path in checkpoints.items():
        copy_model(repository, "generate", f"generate_{kind}", {"model_path": str(path)})
    with TritonServer(repository, log_path=tmp_path_factory.mktemp("checkpoint_logs") / "tritonserver.log") as server:
        yield server


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_a_saved_checkpoint_is_served_and_its_masks_match_a_float64_replay(kind, checkpoints, checkpoint_server):
    from transformers import AutoModelForCausalLM

    vocab, context = ARCHITECTURES[kind][1]["vocab_size"], ARCHITECTURES[kind][1]["max_position_embeddings"]
    replica = AutoModelForCausalLM.from_pretrained(checkpoints[kind], dtype=torch.float64).eval()
    prompts = [[5, 6, 7], [vocab - 1, 40, 41, 42], [9]]
    params = [SamplingParams(**RULES, seed=20 + i, return_sampling_mask=True) for i in range(2)]
    params.append(SamplingParams(temperature=0.0, return_sampling_mask=True))
    with GenerateClient(checkpoint_server.grpc_url, model_name=f"generate_{kind}") as client:
        results = client.generate(prompts, params, 10, ignore_eos=True)
        with pytest.raises(GenerateError) as outside:  # the checkpoint's own vocabulary and context
            client.generate([[vocab]], params[0], 4)
        with pytest.raises(GenerateError) as too_long:
            client.generate([[5] * 10], params[0], context)
    assert f"[0, {vocab})" in outside.value.message
    assert f"context length {context}" in too_long.value.message
    assert any((r.sampling_mask_len > 1).any() for r in results[:2]), "the test should exercise non-trivial supports"
    for prompt, result, p in zip(prompts, results, params):
        assert len(result.output_ids) == 10 and result.finish_reason == "length"
        logits = step_logits(prompt, result.output_ids, model=replica)
        rules = RULES if p.temperature else dict(temperature=0.0)
        assert_matches_reference(result, logits, **rules)
    np.testing.assert_array_equal(results[2].sampling_mask[:, 0], results[2].output_ids)  # greedy: the argmax
