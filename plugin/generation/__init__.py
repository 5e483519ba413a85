"""Token generation without Triton: the causal-LM plugin interface, the default LM, the loop.

Owns `lm` (the `CausalLM` interface, the default tiny Llama and Hugging Face loading), `request`
(a request, its result chunks, its checks, stop ids and per-step seeds) and `engine` (the
continuous-batching loop of a model instance, the one generation loop). May import `sampling`;
imports no Triton, so it runs in-process in tests and benchmarks.
"""
