#!/usr/bin/env bash
# Kernel benchmark on CUDA, for a session lent a GPU: one go, well under 5 minutes.
# Writes bench/results/gpu.json (same schema as latest.json) and bench/results/gpu_ratios.png.
# The served benchmark is CPU-only here (the shipped model is a KIND_CPU instance), so it is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  # A bare GPU machine: a venv with a CUDA torch (pip's default wheel) and the package; no server needed.
  /usr/bin/python3 -m venv .venv
  .venv/bin/python -m pip install --quiet torch numpy matplotlib
  .venv/bin/python -m pip install --quiet --no-deps -e .
fi
.venv/bin/python -c "import matplotlib" 2>/dev/null || .venv/bin/python -m pip install --quiet matplotlib
.venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
exec timeout 280 .venv/bin/python -m bench.run --device cuda --skip-served \
  --output bench/results/gpu.json --plot bench/results/gpu_ratios.png "$@"
