"""prime-rl's generation path: verifiers 0.4.0's TrainClient (renderers 0.1.12 renders the chat and
calls vLLM's POST /inference/v1/generate), as shipped."""

import asyncio
import os

from common import TINY_TOKENIZER, run, served_model


def main(args: dict) -> dict:
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.dialects import ChatDialect
    from verifiers.v1.types import SamplingConfig

    os.environ["COMPAT_API_KEY"] = "EMPTY"
    base = args["url"]
    config = TrainClientConfig(
        base_url=f"{base}/v1", api_key_var="COMPAT_API_KEY", renderer_model_name=str(TINY_TOKENIZER)
    )
    sampling = SamplingConfig(**args["sampling"])
    body = {"model": served_model(base), "messages": [{"role": "user", "content": "Tell me about masks."}]}

    async def call():
        client = TrainClient(config)
        try:
            return await client.get_response(ChatDialect(), body, sampling)
        finally:
            await client.close()

    response = asyncio.run(call())
    tokens = response.tokens
    mask = tokens.sampling_mask
    return {
        "prompt_ids": list(tokens.prompt_ids),
        "completion_ids": list(tokens.completion_ids),
        "completion_logprobs": list(tokens.completion_logprobs),
        "finish_reason": response.finish_reason,
        "mask_counts": None if mask is None else mask.counts.tolist(),
        "mask_ids": None if mask is None else mask.ids.tolist(),
    }


run(main)
