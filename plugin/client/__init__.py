"""What a trainer imports: the typed client, `SamplingParams`, mask converters and replay.

Owns `sampler_client` (sync and asyncio clients over tritonclient HTTP/gRPC), `generate_client`
(the generate model's clients: batches of prompts, streaming, backpressure; its wire in
`generate_transport`), `replicas` (the replica and retry policy both share), `sampling_params`
(per-row parameters checked with the server's own rules), `converters` (masks in SGLang / vLLM /
prime-rl / dense form), `replay` (training log-probs renormalised over the same masks) and `wire`
(tritonclient input tensors for the sampler's inputs). May import `sampling` and `model_config`;
never `pb_utils`, so it runs in any trainer process.
"""

from .generate_client import (
    AsyncGenerateClient,
    AsyncGenerateStream,
    GenerateClient,
    GenerateError,
    GenerateResult,
    GenerateStream,
    concatenate_tokens,
)
from .sampler_client import AsyncSamplerClient, SamplerClient, SamplerError, SampleResult, unregister_shared_memory

__all__ = [
    "AsyncGenerateClient",
    "AsyncGenerateStream",
    "AsyncSamplerClient",
    "GenerateClient",
    "GenerateError",
    "GenerateResult",
    "GenerateStream",
    "SampleResult",
    "SamplerClient",
    "SamplerError",
    "concatenate_tokens",
    "unregister_shared_memory",
]
