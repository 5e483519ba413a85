"""The sampling math: parameters, request rules, seeded noise, the batched sampler and its backends.

Owns `params` (names, dtypes, defaults), `validation` (every rule and its message), `rng` (the
counter-based seeded noise), `sampler` (the batched torch sampler), `fused` (its OpenAI-Triton
kernels for CUDA, imported only when used), `backends` (the registry a deployment picks from) and
`batching` (many requests to one vectorised call and back). Imports torch and numpy (and the
`triton` kernel language where installed): never Triton Inference Server's `pb_utils`,
tritonclient or anything else of this package, so a trainer, a benchmark or another server can use
it as it is.
"""
