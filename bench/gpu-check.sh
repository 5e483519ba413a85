#!/usr/bin/env bash
# The GPU check for a session lent a device machine (one H200, x86-64, no network, a python3 3.12 with
# torch, triton and numpy), in one go: under 9 minutes, under 4 with --quick.
#   1. install: the wheels bench/fetch-gpu-wheels.sh put in .gpu-wheels/ (run it here first, then
#      carry .gpu-wheels) are unpacked into a temporary folder on PYTHONPATH; the package is
#      imported straight from plugin/, as bench/gpu.sh does;
#   2. unit: with SAMPLER_TEST_DEVICE=cuda, the CUDA cases of tests/ (the sampler's reference tests
#      parametrised on cuda) and tests/test_gpu_path.py; a test that needs a wheel left out of the
#      budget is skipped, naming the package;
#   3. bench: bench/gpu.sh, the kernel benchmark on CUDA (--quick: --tiny);
#   then unit-rest (not with --quick): the rest of tests/, in the time left;
#   4. served: only where nvidia-pytriton is importable (its 52.8 MiB wheel does not fit the 64 MiB
#      a device run carries): tritonserver on the KIND_GPU test repository, client_tests/ against it.
#      Each step is bounded so that the whole stays within the deadline; a step out of time is skipped.
# summary.json names the image line this run stands for (the docker/Dockerfile line whose Python
# this interpreter is, with the line's pins beside this machine's versions) and the tritonserver
# the served step ran, if any.
# Logs, JUnit XML and summary.json go to $OUT when set (the device tool brings it back), else to
# .gpu-check/. Without a CUDA device the CUDA-only steps say they are skipped and the unit tests run
# on the CPU, which is how tests/test_gpu_check.py checks this script; such a run's status (step
# `cuda` and summary.json's "status") is no-cuda, never passed: nothing GPU-specific was verified.
#   bench/gpu-check.sh [--quick]
# Environment: GPU_CHECK_PYTHON (python3), GPU_WHEELS (.gpu-wheels), GPU_CHECK_PYTEST_ARGS (replaces
# the selection of step 2), GPU_CHECK_SERVED=1 (step 4 without CUDA too, on the CPU repository),
# GPU_CHECK_CLIENT_ARGS (client_tests), GPU_CHECK_DEADLINE_S (530, --quick 230).
set -euo pipefail
cd "$(dirname "$0")/.."

quick=false
case "${1:-}" in
    --quick) quick=true ;;
    "") ;;
    *) echo "usage: bench/gpu-check.sh [--quick]" >&2; exit 2 ;;
esac
python="${GPU_CHECK_PYTHON:-python3}"
wheels="${GPU_WHEELS:-.gpu-wheels}"
out="${OUT:-.gpu-check}"
if "$quick"; then deadline_s="${GPU_CHECK_DEADLINE_S:-230}"; else deadline_s="${GPU_CHECK_DEADLINE_S:-530}"; fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
steps="$out/steps.tsv"
: >"$steps"

say() { echo "[gpu-check] $*"; }
record() {  # step status seconds detail
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$steps"
    say "$(printf '%-7s %-7s %4ss  %s' "$1" "$2" "$3" "$4")"
}
step_timeout() {  # cap_s: the seconds a step may take, within the overall deadline
    local left=$((deadline_s - SECONDS - 10))
    echo $(($1 < left ? $1 : left))
}
logged() {  # log command...: run it, its output to the terminal and to the log; its status
    local log="$1"
    shift
    "$@" 2>&1 | tee "$log"
    return "${PIPESTATUS[0]}"
}
junit_counts() {  # junit.xml -> "N passed, N failed, N skipped; N CUDA cases ran"
    "$python" - "$1" <<'EOF'
import sys
import xml.etree.ElementTree as ET

cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
failed = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
skipped = sum(1 for c in cases if c.find("skipped") is not None)
cuda = sum(1 for c in cases if "cuda" in c.get("name", "") and c.find("skipped") is None)
print(f"{len(cases) - failed - skipped} passed, {failed} failed, {skipped} skipped; {cuda} CUDA cases ran")
EOF
}

# 0. The interpreter and what it sees.
if ! "$python" - >"$out/environment.json" <<'EOF'
import json, platform, sys

import numpy
import torch

info = {"python": sys.version.split()[0], "machine": platform.machine(), "glibc": platform.libc_ver()[1],
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "numpy": numpy.__version__,
        "cuda_available": torch.cuda.is_available(), "arch_list": torch.cuda.get_arch_list(), "devices": []}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
for index in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(index)
    info["devices"].append({"name": props.name, "capability": f"{props.major}.{props.minor}",
                            "memory_gib": round(props.total_memory / 2**30, 1)})
print(json.dumps(info, indent=1))
EOF
then
    say "$python cannot import torch and numpy: nothing to check (set GPU_CHECK_PYTHON)"
    exit 1
fi
cuda="$("$python" -c 'import json, sys; print(int(json.load(open(sys.argv[1]))["cuda_available"]))' "$out/environment.json")"
device=cpu
[ "$cuda" = 1 ] && device=cuda
say "mode $($quick && echo quick || echo full), $python on $device: $(tr -d '\n' <"$out/environment.json" | cut -c 1-300)"
failed=false
if [ "$cuda" != 1 ]; then
    say "no CUDA device: the CUDA-only steps (bench, served) are skipped and the unit tests run on the CPU"
    # A device machine whose GPU torch cannot use must not pass as a CPU run (unless hidden on purpose).
    if [ -z "${CUDA_VISIBLE_DEVICES+set}" ] && command -v nvidia-smi >/dev/null && nvidia-smi -L >"$out/nvidia-smi.txt" 2>&1; then
        record cuda failed 0 "nvidia-smi lists a GPU but torch sees no CUDA device (see environment.json, nvidia-smi.txt)"
        failed=true
    else
        # Its own status, not "passed": the steps below can pass on the CPU, which verifies nothing GPU-specific.
        record cuda no-cuda 0 "no CUDA device: nothing GPU-specific was verified"
    fi
fi

# 1. The carried wheels, unpacked into a folder of their own (no pip, no index needed).
site="$work/site"
shim="$work/shim"
mkdir -p "$site" "$shim"
ln -s "$PWD/plugin" "$shim/triton_sampling_mask"  # the package name pyproject maps onto plugin/
left_out=""
if [ -f "$wheels/MANIFEST.tsv" ]; then
    cp "$wheels/MANIFEST.tsv" "$out/wheels-manifest.tsv"
    left_out="$(awk -F '\t' '$1 == "left-out" {printf "%s%s", sep, $2; sep = ", "}' "$wheels/MANIFEST.tsv")"
fi
start=$SECONDS
if ! compgen -G "$wheels/*.whl" >/dev/null; then
    record install skipped 0 "no wheels in $wheels: $python's own packages only"
elif "$python" - "$site" "$wheels"/*.whl >"$out/install.log" 2>&1 <<'EOF'; then
import shutil
import sys
import zipfile
from pathlib import Path

site = Path(sys.argv[1])
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    print("unpacked", Path(wheel).name)
# A wheel's <name>.data/purelib|platlib belong at the top of site-packages.
for data in site.glob("*.data"):
    for scheme in ("purelib", "platlib"):
        if (data / scheme).is_dir():
            shutil.copytree(data / scheme, site, dirs_exist_ok=True)
    shutil.rmtree(data)
EOF
    count="$(grep -c '^unpacked' "$out/install.log")"
    record install passed $((SECONDS - start)) "$count wheels from $wheels${left_out:+ (left out of the budget: $left_out)}"
else
    record install failed $((SECONDS - start)) "unpacking $wheels failed (see install.log)"
    failed=true
fi
export PYTHONPATH="$site:$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SAMPLER_TEST_DEVICE="$device"

# The image line this run stands for: docker/Dockerfile's line with this Python (the device's 3.12
# is the current line's), its pins beside the versions here (the wheels above included).
"$python" - "$out" "$wheels" <<'EOF' || say "could not read docker/Dockerfile's lines"
import importlib.metadata
import json
import sys
from pathlib import Path

sys.path.insert(0, "docker")
import image_lines

out, wheels = Path(sys.argv[1]), Path(sys.argv[2])
environment = json.loads((out / "environment.json").read_text())
python = ".".join(environment["python"].split(".")[:2])
_, lines = image_lines.read()
line = next((line for line in lines.values() if line.python == python), None)
here = {"python": environment["python"]}
for package in ("torch", "transformers", "numpy"):
    try:
        here[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        here[package] = None
wheels_line = (wheels / "LINE").read_text().strip() if (wheels / "LINE").is_file() else None
record = {"name": line.name if line else None, "image": line.as_dict() if line else None, "here": here,
          "wheels_for": wheels_line}
(out / "line.json").write_text(json.dumps(record, indent=1) + "\n")
if line:
    pins = ", ".join(f"{p} {here[p]} here / {getattr(line, p)} in the image" for p in ("torch", "transformers", "numpy"))
    print(f"[gpu-check] line {line.name}: Python {python} as docker/Dockerfile's {line.name} line "
          f"({line.base}, Triton {line.triton}); {pins}")
else:
    print(f"[gpu-check] line none: no docker/Dockerfile line has Python {python} "
          f"({', '.join(f'{l.name} {l.python}' for l in lines.values())})")
EOF

# 2. The unit suite, the CUDA cases first (the sampler's reference tests parametrised on cuda, and
#    tests/test_gpu_path.py), the rest after the benchmark. Never here: what checks this host rather
#    than the device (linters, PyPI, this script).
ignores=(--ignore=tests/test_lint.py --ignore=tests/test_container_image.py --ignore=tests/test_gpu_check.py)
# The sampler's CUDA cases (-k cuda), the fused kernels and the hot-path counts (they run on CUDA
# wherever a device is present) and the GPU-path glue.
cuda_selection="cuda or gpu_path or fused_kernels or hot_path or boundaries or cross_path"
cuda_tests=(tests -k "$cuda_selection")
other_tests=(tests -k "not ($cuda_selection)")
# A test or test module that fails only because a third-party package is missing here (its wheel
# was left out of the budget) is reported as skipped, naming the package, not as a failure.
mkdir -p "$work/plugins"
cat >"$work/plugins/gpu_check_missing.py" <<'EOF'
import os
import re

import pytest

PROJECT = {"tests", "client_tests", "bench", "testbed", "triton_sampling_mask"}


def skip(report, nodeid, path, name):
    report.outcome = "skipped"
    report.longrepr = (str(path), 0, f"Skipped: needs {name}, not installed here (its wheel left out of the budget?)")
    with open(os.environ["GPU_CHECK_MISSING_LOG"], "a") as log:
        log.write(f"{nodeid}\t{name}\n")


def third_party(name):
    return name if name and name.split(".")[0] not in PROJECT else None


def missing_module(error):
    """The third-party module whose absence raised `error`, directly or as its cause (tritonclient
    re-raises a missing module as RuntimeError ... from it)."""
    while error is not None:
        if isinstance(error, ModuleNotFoundError):
            return third_party(error.name)
        error = error.__cause__
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    name = missing_module(call.excinfo.value) if report.failed and call.excinfo is not None else None
    if name:
        skip(report, item.nodeid, item.path, name)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    found = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", str(report.longrepr)) if report.failed else None
    name = third_party(found.group(1)) if found else None
    if name:
        skip(report, report.nodeid, collector.path, name)
EOF
unit_step() {  # step cap_s pytest-selection...: one pytest run, recorded as `step`
    local step="$1" cap="$2" start=$SECONDS rc=0 limit detail missing_log="$out/$1-missing.tsv"
    shift 2
    limit="$(step_timeout "$cap")"
    if [ "$limit" -lt 20 ]; then
        record "$step" skipped 0 "no time left within the ${deadline_s}s deadline"
        return
    fi
    : >"$missing_log"
    logged "$out/$step.log" env PYTHONPATH="$work/plugins:$PYTHONPATH" GPU_CHECK_MISSING_LOG="$missing_log" \
        timeout "$limit" "$python" -m pytest -p no:cacheprovider -p gpu_check_missing -q -rs \
        --session-timeout=$((limit - 10)) --junitxml="$out/$step.xml" "${ignores[@]}" "$@" || rc=$?
    detail="$( [ -f "$out/$step.xml" ] && junit_counts "$out/$step.xml" || echo "no results")"
    if [ -s "$missing_log" ]; then
        detail+="; skipped for want of $(cut -f 2 "$missing_log" | sort | uniq -c | awk '{printf "%s%s (%d)", sep, $2, $1; sep = ", "}')"
    fi
    case "$rc" in
        0) record "$step" passed $((SECONDS - start)) "on $device: $detail" ;;
        124) record "$step" failed $((SECONDS - start)) "killed after ${limit}s: $detail"; failed=true ;;
        *) record "$step" failed $((SECONDS - start)) "pytest exit $rc on $device: $detail"; failed=true ;;
    esac
}
if [ -n "${GPU_CHECK_PYTEST_ARGS:-}" ]; then
    read -ra selection <<<"$GPU_CHECK_PYTEST_ARGS"
    unit_step unit 150 "${selection[@]}"
else
    unit_step unit "$("$quick" && echo 90 || echo 150)" "${cuda_tests[@]}"
fi

# 3. The kernel benchmark on CUDA.
if [ "$cuda" != 1 ]; then
    record bench skipped 0 "CUDA-only: bench/gpu.sh times the CUDA kernels and no CUDA device is visible"
elif [ "$(step_timeout 290)" -lt 30 ]; then
    record bench skipped 0 "no time left within the ${deadline_s}s deadline"
else
    start=$SECONDS
    bench_args=()
    "$quick" && bench_args=(--tiny)
    rc=0
    logged "$out/bench.log" env PYTHON="$python" timeout "$(step_timeout 290)" bench/gpu.sh "${bench_args[@]}" || rc=$?
    mkdir -p "$out/bench"
    cp bench/results/gpu* "$out/bench/" 2>/dev/null || true
    if [ "$rc" = 0 ]; then
        record bench passed $((SECONDS - start)) "bench/gpu.sh ${bench_args[*]}: results in $out/bench/"
    else
        record bench failed $((SECONDS - start)) "bench/gpu.sh ${bench_args[*]} exit $rc (see bench.log)"
        failed=true
    fi
fi

# The rest of the unit suite (its CPU cases, on this machine's torch), with the time left.
if [ -z "${GPU_CHECK_PYTEST_ARGS:-}" ] && ! "$quick"; then
    unit_step unit-rest 200 "${other_tests[@]}"
fi

# 4. The real server on the GPUs. The Python backend stub ignores PYTHONPATH and imports from the
#    site-packages of the `python3` first on PATH, so the server runs from a venv whose .pth adds
#    the unpacked wheels, plugin/ and this interpreter's own packages.
served_step() {
    local venv="$work/venv" client_args rc=0
    "$python" -m venv --without-pip "$venv" || { echo "$python -m venv failed: the server needs a venv"; return 1; }
    "$python" - "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gpu-check.pth" \
        "$site" "$shim" "$PWD" <<'EOF' || return 1
import site
import sys

target, *folders = sys.argv[1:]
with open(target, "w") as pth:
    for folder in [*folders, *site.getsitepackages()]:
        pth.write(f"import site; site.addsitedir({folder!r})\n")
EOF
    read -ra client_args <<<"${GPU_CHECK_CLIENT_ARGS:-client_tests}"
    timeout "$(step_timeout 400)" "$venv/bin/python" - "$out" "$device" "$work/served" "${client_args[@]}" <<'EOF' || rc=$?
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from testbed.server import TritonServer, build_external_repository

out, device, work, *client_args = sys.argv[1:]
out, repository = Path(out), Path(work) / "models"
flags = build_external_repository(repository, gpu=device == "cuda")
with TritonServer(repository, extra_args=flags, log_path=out / "tritonserver.log") as server:
    with urllib.request.urlopen(f"http://{server.http_url}/v2", timeout=10) as answer:  # the server's own metadata
        (out / "tritonserver.json").write_text(answer.read().decode())
    env = {**os.environ, "TRITON_EXTERNAL_HTTP_URL": server.http_url, "TRITON_EXTERNAL_GRPC_URL": server.grpc_url,
           "TRITON_EXTERNAL_METRICS_URL": server.metrics_url, "TRITON_EXTERNAL_LOG": str(out / "tritonserver.log"),
           "TRITON_EXTERNAL_MODEL_CONTROL": "explicit"}
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                              f"--junitxml={out / 'client.xml'}", *client_args], env=env))
EOF
    return "$rc"
}
if ! "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("pytriton") is None)'; then
    record served skipped 0 "no nvidia-pytriton here: its 52.8 MiB wheel does not fit the 64 MiB a device run carries (docker/run-gpu-tests.sh runs client_tests/ on GPUs)"
elif [ "$cuda" != 1 ] && [ "${GPU_CHECK_SERVED:-0}" != 1 ]; then
    record served skipped 0 "CUDA-only: the KIND_GPU repository needs a CUDA device (GPU_CHECK_SERVED=1 runs it on the CPU repository)"
elif "$quick"; then
    record served skipped 0 "left to the full check (no --quick)"
elif [ "$(step_timeout 400)" -lt 60 ]; then
    record served skipped 0 "no time left within the ${deadline_s}s deadline"
else
    start=$SECONDS
    rc=0
    logged "$out/served.log" served_step || rc=$?
    detail="$( [ -f "$out/client.xml" ] && junit_counts "$out/client.xml" || echo "no results")"
    if [ "$rc" = 0 ]; then
        record served passed $((SECONDS - start)) "tritonserver on the $device repository, ${GPU_CHECK_CLIENT_ARGS:-client_tests}: $detail"
    else
        record served failed $((SECONDS - start)) "exit $rc: $detail (see served.log, tritonserver.log)"
        failed=true
    fi
fi

"$python" - "$out" "$quick" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
steps = [dict(zip(("step", "status", "seconds", "detail"), line.split("\t", 3)))
         for line in (out / "steps.tsv").read_text().splitlines()]
for step in steps:
    step["seconds"] = int(step["seconds"])
line = json.loads((out / "line.json").read_text()) if (out / "line.json").is_file() else {"name": None}
server = json.loads((out / "tritonserver.json").read_text()) if (out / "tritonserver.json").is_file() else None
line["tritonserver"] = server.get("version") if server else None  # None: no server ran
environment = json.loads((out / "environment.json").read_text())
# The run's one word: failed if any step failed, no-cuda where no GPU was seen (a CPU run verifies
# nothing GPU-specific, however its steps went), passed only for a CUDA run with no failure.
if any(s["status"] == "failed" for s in steps):
    status = "failed"
elif not environment["cuda_available"]:
    status = "no-cuda"
else:
    status = "passed"
summary = {"status": status, "mode": "quick" if sys.argv[2] == "true" else "full", "line": line,
           "environment": environment, "steps": steps}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"[gpu-check] summary (line {line['name'] or 'none'}, tritonserver {line['tritonserver'] or 'none'}): {status}:",
      " | ".join(f"{s['step']} {s['status']}" for s in steps), f"-> {out}/summary.json")
EOF
! "$failed"
