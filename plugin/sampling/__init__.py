"""The sampling math: parameters, request rules, seeded noise, the batched sampler and its backends.

Owns `params` (names, dtypes, defaults and the greedy / top_k conventions), `inputs` and `outputs`
(the wire contract: every input and output of both models), `admin` (the admin header and key
parameter), `refusals` (the busy contract), `validation` (every rule and its message), `rng` (the
counter-based seeded noise), `sampler` (planning and dispatch), its op families `selection` (top-k
in the total order), `normalisers` and `epilogues` (rules, draw, outputs), `results` (what a call
returns), `fused` (the OpenAI-Triton kernels for CUDA, imported only when used), `backends` (the
registry a deployment picks from) and `batching` (many requests to one vectorised call and back).
Imports torch and numpy (and the `triton` kernel language where installed): never Triton Inference
Server's `pb_utils`, tritonclient or anything else of this package, so a trainer, a benchmark or
another server can use it as it is.
"""
