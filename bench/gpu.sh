#!/usr/bin/env bash
# Kernel benchmark on CUDA, for a session lent a GPU: one go, well under 5 minutes.
# Writes bench/results/gpu.json (same schema as latest.json), gpu.md, and gpu_ratios.png when
# matplotlib is there. The served benchmark stays CPU-only (the shipped model is KIND_CPU).
# Installs nothing (a device machine may reach no package index): it uses the first of $PYTHON,
# .venv/bin/python, python3 whose torch sees a GPU, and imports the package straight from plugin/.
# BENCH_DEVICE=cpu runs the same script on a CPU (to check the script itself).
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
plot=(--plot bench/results/gpu_ratios.png)
"$python" -c "import matplotlib" 2>/dev/null || plot=(--no-plot)
"$python" -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
timeout 280 "$python" -m bench.run --device "$device" --skip-served --output bench/results/gpu.json "${plot[@]}" "$@"
