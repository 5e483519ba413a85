"""What the client tests and the benchmarks both run against: real tritonservers and launchers on
free ports (`server`, `fronted`, `api_server`, `stack`), the test repositories and their backends,
the hostile clients of `make hostile`, the load drivers and the process-memory readers.

Not shipped in the wheel; importable from the repository root like `bench` and `client_tests`.
It imports neither of them: they both import it (tests/test_layout.py)."""
