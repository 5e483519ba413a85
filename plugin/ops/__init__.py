"""Running the server: the launcher, the soak load tool and the GPU repository derivation.

Owns `launcher` (finds the `tritonserver` shipped by `nvidia-pytriton` and runs it),
`soak` (the `make soak` load test) and `gpu_repository` (derives the KIND_GPU model repository
from the CPU one). Command-line tools; may import every other subpackage, none imports them.
"""
