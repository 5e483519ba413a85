"""Ahead-of-time compiles of the fused kernels (plugin/sampling/fused.py) for NVIDIA GPUs, on a
machine without one (tests only; tests/test_kernel_compile.py drives it).

Each kernel is compiled exactly as a call would launch it: `fused.sample_packed` and
`fused.debug_noise` run on small CPU tensors with `fused._launch` recording instead of launching,
and Triton's own JIT specialisation turns each recorded launch into the signature, constants and
alignment attributes it would compile; `triton.compile` then builds that for a `GPUTarget` with the
ptxas Triton bundles, and `cuobjdump -res-usage` reads the cubin's registers, local memory (spills)
and stack. Runs in a process of its own: under TRITON_INTERPRET=1 (the unit suite's setting) the
kernels are interpreted functions, which cannot be compiled.

    python -m tests.kernel_compile ARCH SHARE WORKERS < calls.json > results.json
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The architectures checked: Ampere (A100), Hopper (H100/H200, sm_90a), Blackwell datacenter
# (B200, sm_100a) and Blackwell consumer (RTX 50, sm_120a). Shared memory a block may opt into
# on each (cudaDevAttrMaxSharedMemoryPerBlockOptin), in bytes.
ARCHS = {80: "sm_80", 90: "sm_90a", 100: "sm_100a", 120: "sm_120a"}
SHARED_MEMORY_LIMITS = {80: 166912, 90: 232448, 100: 232448, 120: 101376}
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255


def _interpreter_off() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("run with TRITON_INTERPRET unset: interpreted kernels cannot be compiled")


def _ptxas_path(arch: int) -> str:
    """The bundled ptxas that builds `arch` (Triton before 3.5 bundles one for every arch)."""
    import inspect

    from triton.backends.nvidia.compiler import get_ptxas

    return (get_ptxas(arch) if inspect.signature(get_ptxas).parameters else get_ptxas()).path


def arch_support(arch: int) -> str | None:
    """None when the bundled ptxas can build `arch`, else the reason it cannot."""
    try:
        ptxas = _ptxas_path(arch)
    except ImportError as error:
        return f"triton has no NVIDIA backend here ({error})"
    if not ptxas or not Path(ptxas).exists():
        return f"no ptxas for sm_{arch} in this triton"
    if not Path(ptxas).with_name("cuobjdump").exists():
        return f"no cuobjdump beside {ptxas} to read the registers with"
    listing = subprocess.run([ptxas, "--help"], capture_output=True, text=True).stdout
    if f"'{ARCHS[arch]}'" not in listing:
        version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
        return f"{Path(ptxas).name} ({version[-1] if version else '?'}) cannot target {ARCHS[arch]}"
    return None


def _record_launches(run) -> list[tuple]:
    """The launches `run()` makes through fused._launch, recorded instead of run."""
    from triton_sampling_mask.sampling import fused

    recorded = []
    launch = fused._launch
    fused._launch = lambda kernel, grid, *args, **kwargs: recorded.append((kernel, args, kwargs))
    try:
        run()
    finally:
        fused._launch = launch
    return recorded


def _specialise(kernel, args, kwargs) -> dict:
    """What Triton's JIT would compile for this launch: signature, constants, attributes, options
    (as JSON-able values), from its own specialisation of the arguments."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    backend = CUDABackend(GPUTarget("cuda", 90, 32))  # the specialisation does not depend on the arch
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    if hasattr(kernel, "_pack_args"):
        options, signature, constants, attrs = kernel._pack_args(backend, options, bound, specialization, options)
    else:  # Triton before 3.5: the same steps, inline in JITFunction.run
        options, signature, constants, attrs = _pack_args_before_3_5(backend, kernel, bound, specialization, kwargs)
    names = kernel.arg_names
    return dict(
        kernel=kernel.__name__,
        signature=signature,
        constants={names[path[0]]: value for path, value in constants.items()},
        attrs={names[path[0]]: value for path, value in attrs.items() if value},
        options={name: getattr(options, name) for name in ("num_warps", "enable_fp_fusion")},
    )


def _pack_args_before_3_5(backend, kernel, bound, specialization, kwargs) -> tuple:
    """JITFunction._pack_args of later Tritons, as Triton 3.4's JITFunction.run computes it."""
    from triton._utils import find_paths_if, get_iterable_path

    options = backend.parse_options({k: v for k, v in kwargs.items() if k not in kernel.arg_names})
    values = [kind for kind, _ in specialization]
    signature = dict(zip((p.name for p in kernel.params), values))
    paths = find_paths_if(values, lambda _, value: value == "constexpr")
    constants = {path: get_iterable_path(list(bound.values()), path) for path in paths}
    attributes = [attribute for _, attribute in specialization]
    paths = find_paths_if(attributes, lambda _, value: isinstance(value, str))
    attrs = {path: backend.parse_attr(get_iterable_path(attributes, path)) for path in paths}
    return options, signature, constants, attrs


def launch_specs(points: list[dict]) -> list[dict]:
    """The distinct compile specs the calls `points` make: each point is one `sample_packed`
    call (dtype, vocab, k_max, mask_width) or one `debug_noise` call (count)."""
    _interpreter_off()
    import numpy as np
    import torch

    from triton_sampling_mask.sampling import fused
    from triton_sampling_mask.sampling.params import RowParams

    specs = {}
    for point in points:
        if "count" in point:
            seeds, ids = torch.zeros(1, dtype=torch.int64), torch.zeros(1, point["count"], dtype=torch.int64)
            recorded = _record_launches(lambda: fused.debug_noise(seeds, ids))  # noqa: B023
        else:
            logits = torch.zeros(1, point["vocab"], dtype=getattr(torch, point["dtype"]))
            params = torch.from_numpy(fused.pack_params(RowParams.defaults(1), np.full(1, point["k_max"])))
            recorded = _record_launches(
                lambda: fused.sample_packed(logits, params, point["k_max"], point["mask_width"])  # noqa: B023
            )
        for kernel, args, kwargs in recorded:
            spec = _specialise(kernel, args, kwargs)
            specs.setdefault(json.dumps(spec, sort_keys=True), {**spec, "example": point})
    return list(specs.values())


_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def compile_spec(spec: dict, arch: int) -> dict:
    """Compile one spec for `arch`: registers, shared memory (Triton's dynamic allocation plus the
    static), local memory and stack per thread, or the error."""
    _interpreter_off()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton_sampling_mask.sampling import fused

    kernel = getattr(fused, spec["kernel"])
    names = kernel.arg_names
    source = ASTSource(
        kernel,
        spec["signature"],
        {(names.index(name),): value for name, value in spec["constants"].items()},
        {(names.index(name),): value for name, value in spec["attrs"].items()},
    )
    result = dict(kernel=spec["kernel"], arch=arch, example=spec["example"], blocks=_blocks(spec))
    start = time.monotonic()
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=spec["options"])
    except Exception as error:  # a compile error is the finding: report it, do not crash the worker
        return {**result, "error": f"{type(error).__name__}: {str(error)[-3000:]}"}
    result["seconds"] = round(time.monotonic() - start, 2)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        cuobjdump = Path(_ptxas_path(arch)).with_name("cuobjdump")  # bundled with ptxas (arch_support)
        usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True)
    found = _RESOURCES.search(usage.stdout)
    if not found:
        return {**result, "error": f"cuobjdump -res-usage gave no resource line: {usage.stdout}{usage.stderr}"}
    registers, stack, static_shared, local = map(int, found.groups())
    return {
        **result,
        "registers": registers,
        "threads": compiled.metadata.num_warps * 32,
        "shared": compiled.metadata.shared + static_shared,
        "local": local,
        "stack": stack,
    }


def _blocks(spec: dict) -> str:
    """The spec's compile-time choices that vary between calls, in a short label."""
    # Block sizes, and integer arguments Triton specialised to a constant (vocab = 1).
    varying = {name: value for name, value in spec["constants"].items() if name.startswith("BLOCK") or name.islower()}
    dtype = spec["signature"].get("logits_ptr") or spec["signature"].get("values_ptr") or ""
    label = " ".join(f"{name}={value}" for name, value in varying.items())
    aligned = ",".join(sorted(name for name in spec["attrs"] if not name.endswith("_ptr")))
    return f"{dtype.lstrip('*')} {label} warps={spec['options']['num_warps']}" + (f" /16:{aligned}" if aligned else "")


def problems(result: dict) -> list[str]:
    """What makes a compiled kernel unfit for its target: an error, spills, too much shared memory."""
    if "error" in result:
        return [result["error"]]
    found = []
    if result["local"] or result["stack"]:
        found.append(f"local memory (spills): {result['local']} bytes, stack {result['stack']} bytes per thread")
    limit = SHARED_MEMORY_LIMITS[result["arch"]]
    if result["shared"] > limit:
        found.append(f"shared memory {result['shared']} bytes > {limit} on sm_{result['arch']}")
    if result["registers"] > MAX_REGISTERS_PER_THREAD or result["registers"] * result["threads"] > REGISTERS_PER_SM:
        found.append(f"{result['registers']} registers x {result['threads']} threads do not fit an SM")
    return found


def compile_calls(points: list[dict], arch: int, workers: int) -> list[dict]:
    """Compile for `arch` every distinct kernel the calls `points` launch (see `launch_specs`), in
    `workers` processes without the interpreter: each finds the specs and compiles its share."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.kernel_compile", str(arch), str(share), str(workers)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
        )
        for share in range(workers)
    ]
    for process in processes:  # every worker gets its input before any is waited for
        process.stdin.write(json.dumps(points))
        process.stdin.close()
    results = []
    for process in processes:
        out, err = process.stdout.read(), process.stderr.read()
        if process.wait():
            raise RuntimeError(f"compile worker failed ({process.returncode}): {err[-3000:]}")
        results += json.loads(out)
    return results


if __name__ == "__main__":
    arch, share, workers = map(int, sys.argv[1:4])
    calls, answer = json.load(sys.stdin), sys.stdout
    sys.stdout = sys.stderr  # Triton prints a failing kernel's PTX: keep it out of the JSON answer
    json.dump([compile_spec(spec, arch) for spec in launch_specs(calls)[share::workers]], answer)
