"""Triton entry point of the `generate` model: lifecycle glue over the triton_sampling_mask package."""

import triton_python_backend_utils as pb_utils

from triton_sampling_mask.serving.generate_model import GenerateModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = GenerateModel(args, pb_utils)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
