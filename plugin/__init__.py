"""Token sampling with sampling masks for RL rollouts, served by Triton's Python backend.

Subpackages, each depending only on those listed before it:

- `sampling`: the math (parameters, rules, seeded noise, the batched sampler, backends); torch only.
- `generation`: the causal-LM plugin interface and the generation loop; no Triton.
- `client`: what a trainer imports (typed client, `SamplingParams`, converters, replay).
- `api`: the HTTP API process (OpenAI and SGLang dialects, text in and out) over the generate model.
- `serving`: the Triton glue the `model.py` files call (everything that touches `pb_utils`).
- `ops`: running the server (launcher, supervisor, server process, settings, probe, GPU repository).

`model_config` (a model's config as Triton's JSON, and the one config.pbtxt reader) is shared by
`serving`, `client` and `ops`.
"""

__version__ = "0.1.0"
