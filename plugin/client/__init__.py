"""What a trainer imports: the typed client, `SamplingParams`, mask converters and replay.

Owns `sampler_client` (sync and asyncio clients over tritonclient HTTP/gRPC), `generate_client`
(the generate model's clients: batches of prompts, streaming, backpressure; its wire in
`generate_transport`), `replicas` (the replica and retry policy both share), `sampling_params`
(per-row parameters checked with the server's own rules), `converters` (masks in SGLang / vLLM /
prime-rl / dense form), `support` (every format's masks in one flat form, scored by the trainer's
logits), `replay` (training log-probs renormalised over the same masks), `corrections` (exact
off-policy ratios, kept mass, KL / entropy over the support, the centred-score loss), `receipts`
(each token's seed and step, and its re-derivation from the trainer's logits) and `wire`
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
