"""Token generation without Triton: the causal-LM plugin interface, the default LM, the loop.

Owns `lm` (the `CausalLM` interface, the default tiny Llama and Hugging Face loading) and
`generator` (prefill, decode and one sampler call per step for a batch of prompts: the static
scheduler) and `engine` (the continuous-batching loop of a model instance). May import
`sampling`; imports no Triton, so it runs in-process in tests and benchmarks.
"""
