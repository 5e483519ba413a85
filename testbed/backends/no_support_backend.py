"""A custom sampling backend for the tests: samples like torch but declares it builds no support.

The conftest copies this file into a test model's version folder (on the stub's sys.path) and
names it in that model's config as sampling_backend "no_support_backend:NoSupportBackend".
"""

from triton_sampling_mask.sampling.sampler import sample


class NoSupportBackend:
    name = "nosupport"
    builds_support = False

    def sample(self, batch, mask_width):
        return sample(batch, mask_width)
