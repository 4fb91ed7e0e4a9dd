#!/usr/bin/env bash
# The CUDA checks to run when a session has a GPU (device tool), in one short script:
#   1. every test marked `cuda` (graph capture/replay == eager, replay after 3 refits for
#      bf16 / fp8 / fp8_block engines, CUDA IPC refit transport, flash-attn varlen),
# (The benchmarks are CPU-only so far: giving them a --device flag is open work.)
# Usage on the device machine: bash scripts/gpu_check.sh   (writes into ${OUT:-gpu_out}/)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  $PY -m venv .venv && .venv/bin/pip install -q -e ".[test]"  # uses the machine's CUDA torch if present
fi
.venv/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/env.txt"
.venv/bin/python -m pytest -q -m cuda -rs tests 2>&1 | tee "$OUT/cuda_tests.txt"
exit "${PIPESTATUS[0]}"
