"""Token sampling with sampling masks for RL rollouts, served by Triton's Python backend.

The sampler core (`sampler`, `rng`) is plain torch; `validation` holds the request rules
shared by every model and the client; `triton_model` is the glue the model repository's
`model.py` files call; `launcher` starts a real tritonserver from the `nvidia-pytriton` wheel.
"""

__version__ = "0.1.0"
