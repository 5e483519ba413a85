"""Load tools run against a real server (`make soak`, `make stress`, replica and generate throughput); not part of the package."""
