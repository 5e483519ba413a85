"""perf_analyzer, Triton's own C++ load generator, for the served points where its binary runs.

The binary ships in the data files of the `tritonclient==2.51.0` wheel (the server's line; later
wheels dropped it, and PyPI's `perf-analyzer` is an empty placeholder). `make bench` installs that
wheel, without its Python dependencies, into a venv of its own (`.venv/perf-analyzer`, so the
project's tritonclient stays the newer one its BF16 client path needs), with
`nvidia-cuda-runtime-cu12` for `libcudart.so.12`, and Debian's `libb64-0d` for `libb64.so.0d`
where it runs as root with apt. Where the binary is missing or cannot start, `locate()` says why
and the benchmarks fall back to their Python load generator.

Inputs travel as real data: a JSON file (`--input-data`) with one step per row, the logits as
base64 of their raw bytes (FP32 or BF16), every other input as a list. perf_analyzer's system
shared memory mode refuses a model with optional inputs, so the points it drives run the
`bench_sampler*` variants (`bench_models`): the shipped config with every input required and, for
BF16, the logits data_type changed (the same model code; the shipped `sampler` is untouched).
"""

from __future__ import annotations

import base64
import csv
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .common import MODEL_REPOSITORY, REPO_ROOT

# Where `make bench` installs the tritonclient 2.51.0 wheel that carries the binary.
PA_VENV = REPO_ROOT / ".venv" / "perf-analyzer"
ENV_BINARY = "PERF_ANALYZER"  # an explicit path to a perf_analyzer binary wins over the venv's
# Variants of the shipped sampler the perf_analyzer points run (see the module docstring).
BENCH_MODELS = {"FP32": "bench_sampler", "BF16": "bench_sampler_bf16"}


@dataclass
class PerfAnalyzer:
    """A perf_analyzer binary that starts here, and the environment it starts in."""

    binary: str
    env: dict = field(repr=False)
    version: str

    def run(self, args: list[str], timeout_s: float) -> tuple[subprocess.CompletedProcess, float]:
        """Run perf_analyzer with `args`; the completed process and its CPU seconds (user + system)."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(
            [self.binary, *args], env=self.env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        return done, cpu


def _cuda_runtime_dirs(binary: str) -> list[str]:
    """The `nvidia/cuda_runtime/lib` folders (libcudart.so.12) of the binary's venv, the perf_analyzer
    venv and this one."""
    found = []
    for prefix in dict.fromkeys((Path(binary).resolve().parent.parent, PA_VENV, Path(sys.prefix))):
        found += sorted(str(p) for p in prefix.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib") if p.is_dir())
    return found


def locate() -> tuple[PerfAnalyzer | None, str]:
    """(perf_analyzer, its version line), or (None, why not) when no binary starts here."""
    candidates = [
        os.environ.get(ENV_BINARY, ""),
        str(PA_VENV / "bin" / "perf_analyzer"),
        shutil.which("perf_analyzer") or "",
    ]
    binary = next((c for c in candidates if c and os.access(c, os.X_OK)), None)
    if binary is None:
        return None, (
            f"no perf_analyzer binary (${ENV_BINARY}, {PA_VENV.relative_to(REPO_ROOT)}/bin, PATH); "
            "`make bench` installs it from tritonclient==2.51.0"
        )
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*_cuda_runtime_dirs(binary), *filter(None, [env.get("LD_LIBRARY_PATH")])])
    try:
        done = subprocess.run([binary, "--version"], env=env, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{binary} does not start: {exc!r}"
    output = done.stdout + "\n" + done.stderr  # 2.51 prints its version on stderr
    line = next((ln.strip() for ln in output.splitlines() if "Perf Analyzer Version" in ln), None)
    if done.returncode != 0 or line is None:
        why = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return None, f"{binary} does not start (exit {done.returncode}): {why[-1] if why else 'no output'}"
    return PerfAnalyzer(binary, env, line), line


def bench_models(repository: Path) -> list[str]:
    """Write the `bench_sampler*` variants into `repository` (a copy of the shipped one); their names."""
    base = (MODEL_REPOSITORY / "sampler" / "config.pbtxt").read_text()
    for datatype, name in BENCH_MODELS.items():
        text = base.replace('name: "sampler"', f'name: "{name}"')
        text, count = re.subn(r'(name:\s*"logits",\s*data_type:\s*)TYPE_\w+', rf"\g<1>TYPE_{datatype}", text)
        if count != 1:
            raise RuntimeError(
                "the logits input is not where bench/perf_analyzer.py expects it in sampler/config.pbtxt"
            )
        text = re.sub(r",\s*optional:\s*true", "", text)
        target = Path(repository) / name
        shutil.copytree(MODEL_REPOSITORY / "sampler", target, ignore=shutil.ignore_patterns("__pycache__"))
        (target / "config.pbtxt").write_text(text)
    return list(BENCH_MODELS.values())


# A model that reads nothing and answers zeros: the Python backend's own cost per call, without the
# sampler (served_call times it over gRPC + shm: Triton's copy into the stub's pool shows as
# compute_input; anything the stub does to the input before `execute` shows as compute_infer).
NOOP_MODELS = {"FP32": "bench_noop", "BF16": "bench_noop_bf16"}
_NOOP_MODEL_PY = '''"""bench/ no-op model: reads no input, answers output_ids zeros (one row each)."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "logits").shape()[0]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("output_ids", np.zeros((rows, 1), np.int32))]))
        return responses
'''
_NOOP_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
{dynamic_batching}
input [ {{ name: "logits", data_type: TYPE_{datatype}, dims: [ -1 ] }} ]
output [ {{ name: "output_ids", data_type: TYPE_INT32, dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""


def _config_block(text: str, key: str) -> str:
    """`key { ... }` from config.pbtxt text (comments dropped, nested braces kept), or ""."""
    text = re.sub(r"#[^\n]*", "", text)
    start = re.search(rf"\b{key}\s*{{", text)
    if start is None:
        return ""
    depth = 0
    for end in range(start.end() - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return "\n".join(line for line in text[start.start() : end + 1].splitlines() if line.strip())
    raise RuntimeError(f"unbalanced braces after {key!r} in sampler/config.pbtxt")


def noop_models(repository: Path) -> list[str]:
    """Write the no-op models (NOOP_MODELS) into `repository`, batched as the shipped sampler is
    (its max_batch_size and dynamic_batching block)."""
    base = (MODEL_REPOSITORY / "sampler" / "config.pbtxt").read_text()
    max_batch_size = re.search(r"max_batch_size:\s*(\d+)", base)
    for datatype, name in NOOP_MODELS.items():
        target = Path(repository) / name / "1"
        target.mkdir(parents=True)
        (target / "model.py").write_text(_NOOP_MODEL_PY)
        (target.parent / "config.pbtxt").write_text(
            _NOOP_CONFIG.format(
                name=name,
                datatype=datatype,
                max_batch_size=max_batch_size.group(1) if max_batch_size else 256,
                dynamic_batching=_config_block(base, "dynamic_batching"),
            )
        )
    return list(NOOP_MODELS.values())


def write_input_data(path: Path, logits: np.ndarray, params: dict[str, np.ndarray]) -> Path:
    """perf_analyzer's --input-data JSON: one step per row of `logits` [N, V] (FP32 or BF16, as raw
    bytes in base64) with that row's value of every parameter in `params` (arrays of length N)."""
    steps = []
    for i, row in enumerate(np.ascontiguousarray(logits)):
        step = {"logits": {"b64": base64.b64encode(row.tobytes()).decode(), "shape": [row.shape[0]]}}
        for name, values in params.items():
            value = values[i].item()
            step[name] = [bool(value) if isinstance(value, (bool, np.bool_)) else value]
        steps.append(step)
    path.write_text(json.dumps({"data": steps}))
    return path


def _parse(stdout: str, csv_path: Path) -> dict:
    """Client-side figures from the CSV report (-f) and the stdout summary, in ms."""
    with open(csv_path, newline="") as handle:
        row = next(csv.DictReader(handle))
    out = {
        "rows_per_s": float(row["Inferences/Second"]),
        "p50_ms": float(row["p50 latency"]) / 1e3,
        "p90_ms": float(row["p90 latency"]) / 1e3,
        "p99_ms": float(row["p99 latency"]) / 1e3,
        "client_send_ms": float(row["Client Send"]) / 1e3,
        "network_server_ms": float(row["Network+Server Send/Recv"]) / 1e3,
        "client_recv_ms": float(row["Client Recv"]) / 1e3,
    }
    count = re.search(r"Client:\s*\n\s*Request count:\s*(\d+)", stdout)
    mean = re.search(r"Avg latency:\s*(\d+)\s*usec", stdout)
    out["requests"] = int(count.group(1)) if count else 0
    out["mean_ms"] = int(mean.group(1)) / 1e3 if mean else float("nan")
    return out


def measure(
    pa: PerfAnalyzer,
    url: str,
    protocol: str,
    model: str,
    input_data: Path,
    batch: int,
    vocab: int,
    shared_memory: bool,
    output_bytes: int,
    work_dir: Path,
    *,
    concurrency: int = 1,
    request_count: int | None = None,
    window_ms: int | None = None,
    window_requests: int | None = None,
    timeout_s: float = 300.0,
) -> dict:
    """One perf_analyzer point: `request_count` requests (a fixed count, no stability search), or
    three windows of `window_ms` each, or of `window_requests` requests each, accepted as they come
    (perf_analyzer calls three windows stable when max/min of their rates and of their mean latencies
    is within 1 + s/100; s = 100000 accepts any, so the ~0.5 s queue stalls seen on this machine, or
    its load, cannot make it search on or fail). A window with no request completed still fails (the
    caller falls back to the Python generator). Returns rows/s, latency percentiles, mean and
    perf_analyzer's own CPU seconds; raises RuntimeError with its output when it fails."""
    tag = f"{model}-{protocol}{'-shm' if shared_memory else ''}-c{concurrency}"
    csv_path = work_dir / f"{tag}.csv"
    args = [
        "-m",
        model,
        "-i",
        protocol,
        "-u",
        url,
        "-b",
        str(batch),
        "--input-data",
        str(input_data),
        "--shape",
        f"logits:{vocab}",
        "--concurrency-range",
        str(concurrency),
        "-f",
        str(csv_path),
        "--shared-memory",
        "system" if shared_memory else "none",
    ]
    if shared_memory:  # per output tensor; sampling_mask / sampling_mask_logprobs [B, W] are the largest
        args += ["--output-shared-memory-size", str(max(output_bytes, 1024))]
    if request_count is not None:
        args += ["--request-count", str(request_count)]
    elif window_ms is not None:
        args += ["--measurement-interval", str(window_ms), "-s", "100000", "-r", "3"]
    else:
        args += [
            "--measurement-mode",
            "count_windows",
            "--measurement-request-count",
            str(window_requests),
            "-s",
            "100000",
            "-r",
            "3",
        ]
    done, cpu_s = pa.run(args, timeout_s)
    if done.returncode != 0 or not csv_path.exists():
        tail = (done.stdout[-1500:] + "\n" + done.stderr[-1500:]).strip()
        raise RuntimeError(f"perf_analyzer {tag} exited {done.returncode}:\n{tail}")
    return {**_parse(done.stdout, csv_path), "client_cpu_s": cpu_s}
