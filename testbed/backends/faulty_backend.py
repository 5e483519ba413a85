"""A sampling backend for the tests that always fails: an internal fault inside `execute`.

test_reload.py copies this file into a test model's version folder (on the stub's sys.path) and
names it in that model's config as sampling_backend "faulty_backend:FaultyBackend".
"""


class FaultyBackend:
    name = "faulty"
    builds_support = True

    def sample(self, batch, mask_width):
        raise RuntimeError("injected sampler fault")
