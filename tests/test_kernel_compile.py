"""The fused kernels compile for the GPUs users have, checked on a machine without one.

Every kernel of plugin/sampling/fused.py is compiled ahead of time (tests/kernel_compile.py) as
the dispatcher would launch it, with Triton's bundled ptxas, for sm_80 (A100), sm_90a
(H100/H200), sm_100a (B200) and sm_120a (RTX 50); an architecture the toolchain cannot target is
skipped, naming why. A compile error, local memory (register spills) or more shared memory than
the target allows fails the test, which prints registers and shared memory per kernel.

The default run compiles every kernel for every architecture (bf16 and fp32 logits, the largest
row block, candidate blocks of 512 and 128); the `slow` run compiles every dtype and block size
the dispatcher can choose on every architecture.
"""

from __future__ import annotations

import os

import pytest

from triton_sampling_mask.sampling import fused
from triton_sampling_mask.sampling.selection import candidate_count

from .kernel_compile import ARCHS, arch_support, compile_calls, problems

pytestmark = pytest.mark.skipif(not fused.AVAILABLE, reason="triton is not installed")

DTYPES = ("float32", "bfloat16", "float16")
# The vocabularies of widely used models (some not a multiple of 16, which Triton specialises on),
# and every power of two up to 2**18, so every block size the dispatcher picks occurs.
MODEL_VOCABS = (32000, 50257, 128256, 151936, 152064, 256000, 262144)
VOCABS = sorted({1 << i for i in range(19)} | set(MODEL_VOCABS))
# The mask width enters only as a runtime argument and the packed row stride (6 + 2 W); the
# shipped width is compiled.
MASK_WIDTH = 512
NOISE_POINT = dict(count=512)  # debug_noise, the tests' kernel


def every_call(dtypes=DTYPES, vocabs=VOCABS) -> list[dict]:
    """One `sample_packed` call per distinct set of block sizes the dispatcher picks, for each
    dtype and vocabulary, and the noise kernel's call."""
    points = []
    for dtype in dtypes:
        for vocab in vocabs:
            seen = set()
            for k_max in range(1, min(vocab, fused.MAX_TOP_K) + 1):
                blocks = tuple(fused.block_sizes(vocab, candidate_count(k_max, vocab)).items())
                if blocks not in seen:
                    seen.add(blocks)
                    points.append(dict(dtype=dtype, vocab=vocab, k_max=k_max, mask_width=MASK_WIDTH))
    return [*points, NOISE_POINT]


def default_calls() -> list[dict]:
    """Every kernel in a few quick compiles: the largest row block (a 151936 vocabulary) with bf16
    logits and top_k 256 (a 512 candidate block) and with fp32 logits and top_k 50, and the noise
    kernel. The largest candidate block (top_k 1024) takes half a minute to compile: `slow` does it."""
    return [
        dict(dtype="bfloat16", vocab=151936, k_max=256, mask_width=MASK_WIDTH),
        dict(dtype="float32", vocab=151936, k_max=50, mask_width=MASK_WIDTH),
        NOISE_POINT,
    ]


def compile_and_report(points: list[dict], arch: int, capsys) -> None:
    reason = arch_support(arch)
    if reason:
        pytest.skip(reason)
    workers = max(1, min(4, os.cpu_count() or 1, len(points) // 2))  # compiling is CPU-bound
    results = compile_calls(points, arch, workers)
    assert {result["kernel"] for result in results} == {"_row_stats_kernel", "_select_kernel", "_noise_kernel"}
    failures = []
    with capsys.disabled():
        print(f"\n{ARCHS[arch]}: {len(results)} kernels")
        for result in sorted(results, key=lambda r: (r["kernel"], r["blocks"])):
            found = problems(result)
            if "error" not in result:
                print(
                    f"  {result['kernel']:<18} {result['blocks']:<48} {result['registers']:>3} registers"
                    f"  {result['shared']:>6} B shared  local {result['local']}  {result['seconds']:>5.1f} s"
                )
            failures += [
                f"{result['kernel']} {result['blocks']} on {ARCHS[arch]} (e.g. {result['example']}): {p}" for p in found
            ]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("arch", sorted(ARCHS), ids=[ARCHS[a] for a in sorted(ARCHS)])
def test_every_kernel_compiles(arch, capsys):
    compile_and_report(default_calls(), arch, capsys)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("arch", sorted(ARCHS), ids=[ARCHS[a] for a in sorted(ARCHS)])
def test_every_configuration_compiles(arch, capsys):
    compile_and_report(every_call(), arch, capsys)
