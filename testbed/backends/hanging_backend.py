"""A sampling backend for the readiness test: the real sampler, except that a batch whose vocabulary
is HANG_VOCAB wide holds `execute` for HANG_SECONDS: a stub that stops answering while Triton's
own health check of it still passes.

test_recovery.py copies this file into a test model's version folder (on the stub's sys.path) and
names it as sampling_backend "hanging_backend:HangingBackend".
"""

import time

from triton_sampling_mask.sampling.backends import TorchSamplingBackend

HANG_VOCAB = 13
HANG_SECONDS = 12.0


class HangingBackend(TorchSamplingBackend):
    name = "hanging"

    def sample(self, batch, mask_width):
        if batch.logits.shape[-1] == HANG_VOCAB:
            time.sleep(HANG_SECONDS)
        return super().sample(batch, mask_width)
