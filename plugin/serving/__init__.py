"""Everything that touches Triton's Python backend (`pb_utils`): the glue the `model.py` files call.

Owns `triton_io` (request tensors in, response tensors out), `deployment` (what config.pbtxt sets
up for a model's sampler, shared by both models), `sampler_model` and `generate_model` (the two
models' lifecycles) and `metrics` (each model's custom Prometheus metrics).
`pb_utils` is passed in by `model.py`, never imported, so these modules import without a server.
May import `sampling`, `generation` and `model_config`; nothing here is imported by them.
"""
