"""Sampling backends the test repositories load beside the shipped one (copied into a model's
version folder and named by its `sampling_backend` parameter)."""
