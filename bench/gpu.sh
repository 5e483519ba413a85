#!/usr/bin/env bash
# Kernel benchmark on CUDA, for a session lent a GPU: one command, no network, under 5 minutes
# (about 2-3 on an H200). Runs `python -m bench.run --grid gpu`: B {1, 8, 64, 256} x
# V {32000, 151936, 262144} x top_k {50, 512}, each case timing ours fused (fused=None), ours on the
# plain torch path (fused=False), FlashInfer's top_k_top_p_sampling_from_logits (where
# `import flashinfer` works and its first call finishes within 60 s), a vLLM-style torch sampler,
# the SGLang-style full-sort baseline and the floor; then the top-p case without a mask.
# Writes bench/results/gpu.json after every case (the same schema as latest.json; a run cut short
# keeps what finished), then gpu.md, and gpu_ratios.png when matplotlib is there. The served
# benchmark stays CPU-only (the shipped model is KIND_CPU).
# Installs nothing (a device machine may reach no package index): it uses the first of $PYTHON,
# .venv/bin/python, python3 whose torch sees a GPU, and imports the package straight from plugin/.
# BENCH_DEVICE=cpu runs the same script on a CPU on the tiny grid (to check the script itself;
# FlashInfer is skipped with the reason printed), writing ${TMPDIR:-/tmp}/bench_gpu_selfcheck.json.
# BENCH_OUTPUT=path overrides the JSON path; extra arguments go to bench.run.
set -euo pipefail
cd "$(dirname "$0")/.."
device="${BENCH_DEVICE:-cuda}"
check="import torch, sys; sys.exit(0 if '$device' == 'cpu' or torch.cuda.is_available() else 1)"
python=""
for candidate in "${PYTHON:-}" .venv/bin/python python3; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$check" 2>/dev/null; then
    python="$candidate"
    break
  fi
done
if [ -z "$python" ]; then
  echo "gpu.sh: no Python whose torch sees a CUDA device (set PYTHON=/path/to/python)" >&2
  exit 1
fi
shim="$(mktemp -d)"
trap 'rm -rf "$shim"' EXIT
ln -s "$PWD/plugin" "$shim/triton_sampling_mask"  # the package name pyproject maps onto plugin/
export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# No network on a device machine: nothing may wait on a download.
export HF_HUB_OFFLINE=1 PIP_NO_INDEX=1
if [ "$device" = cpu ]; then
  output="${BENCH_OUTPUT:-${TMPDIR:-/tmp}/bench_gpu_selfcheck.json}"
  size=(--tiny)
else
  output="${BENCH_OUTPUT:-bench/results/gpu.json}"
  size=()
fi
plot=(--plot "${output%.json}_ratios.png")
"$python" -c "import matplotlib" 2>/dev/null || plot=(--no-plot)
"$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'on', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
"$python" -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton: not importable (ours runs the plain torch path)"
# The docker/Dockerfile line with this Python (the device's 3.12: current), so a result names its line.
py="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
echo "image line: $("$python" docker/image_lines.py --python "$py" --get name || echo "none (no docker/Dockerfile line has Python $py)")"
# 280 s: the run's own budget is about 2-3 minutes; the JSON holds every finished case if it is cut.
timeout 280 "$python" -m bench.run --device "$device" --grid gpu "${size[@]}" --skip-served \
  --output "$output" "${plot[@]}" "$@"
