"""Running the server: the launcher, the supervisor, the server process and its settings.

Owns `launcher` (the command line of `make serve` and the image), `server_process` (the
`tritonserver` of `nvidia-pytriton` or of a Triton image: its environment, flags and locked admin
APIs; the tests' child server on it is `testbed.server.TritonServer`), `child` (how every child process
is started, stopped and restarted), `supervisor` (restarts, a
model watchdog, the readiness endpoint), `proxy` (the front door: HAProxy on the public ports
running `haproxy/haproxy.cfg`, given values from the settings and, by `model_limits`, from the
model configs; `door_commands`: its other children's command lines), `stream_gate`
(bounds the requests a gRPC stream has open), `memory_limit` (a cgroup or address-space limit
around tritonserver), `settings` (every environment variable with its default and meaning),
`probe` (one real inference, for Kubernetes exec probes), `shm_cleanup` (removes a dead server's
/dev/shm regions), `allocator` (jemalloc for tritonserver) and `gpu_repository` (derives the
KIND_GPU model repository from the CPU one). It talks to the server over HTTP and
imports nothing from the client (tests/test_layout.py); the load tools live in `bench/load/`.
"""
