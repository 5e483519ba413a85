"""Benchmarks of the sampler (kernel level and served); run with `make bench`, not part of the tests."""
