"""The Triton compiler of each image line against the oldest one the fused kernels are checked with.

`fused.MIN_TRITON` is that version: the kernels' interpreter tests and ahead-of-time compiles
(tests/test_fused_kernels.py, tests/test_kernel_compile.py) pass with it. An image line's Triton is
the one its torch pins; a line below the minimum serves without the fused path (docs/deploy.md).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

from triton_sampling_mask.sampling import fused

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docker"))
import image_lines  # noqa: E402  (docker/, standard library only)

# The Triton each torch release pins on Linux x86_64, from its wheels' requires_dist
# (`pip install --dry-run --no-deps --report - torch==X` shows it without downloading the wheel).
TRITON_OF_TORCH = {"2.11.0": "3.6.0", "2.5.1": "3.1.0"}
# Lines that serve without the fused kernels, their Triton being older than the minimum.
WITHOUT_FUSED = {"2.51"}


def test_each_line_runs_the_kernels_only_on_a_triton_they_are_checked_with():
    default, lines = image_lines.read()
    for line in lines.values():
        assert line.torch in TRITON_OF_TORCH, f"line {line.name}: add the Triton that torch {line.torch} pins"
        meets = fused.version_tuple(TRITON_OF_TORCH[line.torch]) >= fused.MIN_TRITON
        assert meets == (line.name not in WITHOUT_FUSED), (line.name, TRITON_OF_TORCH[line.torch])
    assert default not in WITHOUT_FUSED, "the default line must run the fused kernels"


def test_the_local_triton_is_the_minimum_or_later_and_the_test_extra_says_so():
    (test_extra,) = re.findall(r"^test = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    (pin,) = re.findall(r'"triton>=(\d+\.\d+)', test_extra)
    assert pin == ".".join(map(str, fused.MIN_TRITON))
    if fused.TRITON_VERSION is not None:
        assert (fused.version_tuple(fused.TRITON_VERSION) >= fused.MIN_TRITON) == fused.AVAILABLE


def test_version_strings_are_read_as_major_minor():
    assert fused.version_tuple("3.1.0") < fused.MIN_TRITON <= fused.version_tuple("3.4.0+git1a2b3c")
    assert fused.version_tuple("3.10.0") > fused.version_tuple("3.9.1") and fused.version_tuple("4") == (4, 0)


OLD_TRITON_PROBE = """
import sys, types
old = types.ModuleType("triton"); old.__version__ = "3.1.0"
old.language = types.ModuleType("triton.language")
sys.modules["triton"], sys.modules["triton.language"] = old, old.language
import numpy as np, torch
from triton_sampling_mask.sampling import fused, sampler
from triton_sampling_mask.sampling.params import RowParams
from triton_sampling_mask.sampling.sampler import SamplingBatch, sample
assert not fused.AVAILABLE and not sampler._fused_available()
rows = 3
batch = SamplingBatch.from_arrays(torch.randn(rows, 100), np.ones(rows), np.full(rows, 5), np.ones(rows),
                                  np.zeros(rows), np.arange(rows), np.ones(rows, bool))
print("sampled:", sample(batch, 8, device_path="gpu").host()["sampling_mask_len"].tolist())
try:
    fused.sample_packed(torch.zeros(2, 100), torch.from_numpy(fused.pack_params(RowParams.defaults(2), np.full(2, 5))), 5, 8)
except RuntimeError as error:
    print("refused:", error)
"""


def test_an_older_triton_leaves_the_fused_path_off_and_the_torch_ops_serve():
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(OLD_TRITON_PROBE)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sampled: [5, 5, 5]" in done.stdout
    assert "refused: sampling.fused needs triton >= 3.4, found 3.1.0" in done.stdout
