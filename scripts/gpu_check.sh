#!/usr/bin/env bash
# The CUDA checks to run when a session has a GPU (device tool), in one short script:
#   1. every test marked `cuda` (graph capture/replay == eager, replay after 3 refits for
#      bf16 / fp8 / fp8_block engines, graphs captured by a refit-only start with a verified
#      FP8 refit of CUDA trainer tensors, CUDA IPC refit transport, flash-attn varlen),
#   2. benchmarks/cuda_paths.py: graph replay vs eager decode-step time and refit GB/s vs
#      copy_, for bf16 / fp8 / fp8_block engines (also checks replay == eager bitwise).
# Usage on the device machine: bash scripts/gpu_check.sh   (writes into ${OUT:-gpu_out}/)
# Locally (CPU): PYTHON=.venv/bin/python bash scripts/gpu_check.sh  -> CUDA tests skip, bench fails fast.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
# The device image has python3 with a CUDA torch, transformers, pytest, scipy and the rest
# of our dependencies, and no network: run from the source tree, install nothing.
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/env.txt"
$PY -m pytest -q -m cuda -rs -p no:cacheprovider tests 2>&1 | tee "$OUT/cuda_tests.txt"
tests_rc=${PIPESTATUS[0]}
$PY benchmarks/cuda_paths.py --device cuda --json "$OUT/cuda_paths.json" 2>&1 | tee "$OUT/cuda_paths.txt"
bench_rc=${PIPESTATUS[0]}
exit $(( tests_rc != 0 ? tests_rc : bench_rc ))
