"""A sampling backend for the load-shedding test: the real sampler, 0.5 s slower per execute, so a
burst of requests fills what the proxy lets through and then its queue.

test_load_shedding.py copies this file into a test model's version folder (on the stub's sys.path)
and names it as sampling_backend "slow_backend:SlowBackend".
"""

import time

from triton_sampling_mask.sampling.backends import TorchSamplingBackend

EXECUTE_SECONDS = 0.5


class SlowBackend(TorchSamplingBackend):
    name = "slow"

    def sample(self, batch, mask_width):
        time.sleep(EXECUTE_SECONDS)
        return super().sample(batch, mask_width)
