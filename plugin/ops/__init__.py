"""Running the server: the launcher, the supervisor and the GPU repository derivation.

Owns `launcher` (finds the `tritonserver` shipped by `nvidia-pytriton`, or a Triton image's own,
and runs it under `supervisor`: restarts, a model watchdog, the readiness endpoint, locked admin
APIs), `probe` (one real inference, for Kubernetes exec probes), `shm_cleanup` (removes a dead
server's /dev/shm regions), `allocator` (jemalloc for tritonserver) and `gpu_repository` (derives
the KIND_GPU model repository from the CPU one). The load tools live in `bench/load/`.
Command-line tools; may import every other subpackage, none imports them.
"""
