#!/usr/bin/env bash
# The CUDA checks to run when a session has a GPU (device tool), in one short script that
# cannot hang: every step runs under `timeout`, and the limits add up to under 8 minutes.
#   1. cuda_tests: every test marked `cuda` (graph capture/replay == eager, graphs on the
#      engine's device, replay after refits for bf16 / fp8 / fp8_block, refit-only start,
#      verified FP8 refit of CUDA tensors, CUDA IPC transport with its syncs, flash decode,
#      FP8 GEMM gating / compiled activation quantization, vectorized FP8 quantization,
#      MoE decode replay == eager in fp32 / bf16 and with MXFP4 experts across verified refits,
#      continuous batching: requests joining / leaving across graph buckets and a refit
#      mid-generation, graph engine == eager engine, every address kept; DeepSeek-V3 MLA:
#      latent-space decode replay == eager after verified refits of kv_b_proj, unquantized /
#      fp8 / fp8_block+mxfp4, the absorbed w_uk / w_uv caches kept at their addresses;
#      tensor-parallel engine TP=2 == the whole engine for dense / MoE / MLA: one GPU runs
#      both ranks over gloo (eager), two GPUs run NCCL with CUDA graphs captured around the
#      decode step's all-reduces and all-gathers);
#   2. cuda_paths: benchmarks/cuda_paths.py (graph replay vs eager decode step, decode cost at
#      max_seq_len 4096 vs 512, refit GB/s vs copy_; replay == eager bitwise);
#   3. e2e: scripts/gpu_e2e.py, 5 GRPO steps of the default job on CUDA, bf16 and FP8
#      rollout, refit_verify on, asserting the decode graphs were captured and replayed;
#   4. vllm_cuda: the `cuda` tests of tests/vllm_backend (rollout.backend=vllm: FP8 graph replay after
#      verified refits == eager, sleep/wake around a refit frees the KV cache and keeps
#      addresses, 2 GRPO steps with FP8 + free_cache_engine). Skipped (not failed) when the
#      image has no CUDA build of vLLM; kept apart from step 1 so its engine starts (one
#      vLLM engine per process, built one after another) cannot eat step 1's time.
# Then a one-screen summary: each CUDA test and benchmark row, PASS/FAIL.
# Usage on the device machine: bash scripts/gpu_check.sh   (logs + JSON rows in ${OUT:-gpu_out}/)
# Locally (CPU): PYTHON=.venv/bin/python bash scripts/gpu_check.sh  -> CUDA tests skip, bench/e2e fail fast.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
# The device image has python3 with a CUDA torch, transformers, pytest, scipy and the rest
# of our dependencies, and no network: run from the source tree, install nothing.
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Limits (s), worst case 25+180+100+110+120+15 + 5*5 kill grace = 575 s < 10 min (the device
# tool's per-command cap).
T_ENV=${T_ENV:-25} T_TESTS=${T_TESTS:-180} T_BENCH=${T_BENCH:-100} T_E2E=${T_E2E:-110} T_VLLM=${T_VLLM:-120}
T_SUMMARY=15
START=$SECONDS
declare -A RC SECS

step() {  # step NAME LIMIT_S CMD... : stdout+stderr -> $OUT/NAME.log, killed at the limit
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1 </dev/null
  RC[$name]=$?
  SECS[$name]=$((SECONDS - t0))
  local note=""
  [ "${RC[$name]}" -eq 124 ] || [ "${RC[$name]}" -eq 137 ] && note=" (TIMED OUT at ${limit}s)"
  echo "[gpu_check] $name: rc=${RC[$name]} in ${SECS[$name]}s$note -> $OUT/$name.log"
}

step env "$T_ENV" "$PY" -c "
import torch
cuda = torch.cuda.is_available()
print('torch', torch.__version__, '| cuda', torch.version.cuda, cuda, '|',
      torch.cuda.get_device_name(0) if cuda else 'no GPU', torch.cuda.get_device_capability(0) if cuda else '',
      '| GPUs', torch.cuda.device_count())
try:
    import flash_attn; print('flash_attn', flash_attn.__version__)
except Exception as e: print('flash_attn: absent (', type(e).__name__, ')')
try:
    import triton; print('triton', triton.__version__)
except Exception as e: print('triton: absent')
from hybridrl.vllm_backend import vllm_available
print('vllm', 'present' if vllm_available() else 'absent (tests/vllm_backend cuda tests will skip)')
"
TIMEOUT_OPT=()
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_OPT=(--timeout=90)  # per test, where installed
step cuda_tests "$T_TESTS" "$PY" -m pytest -v -m cuda -rs -p no:cacheprovider --continue-on-collection-errors ${TIMEOUT_OPT[@]+"${TIMEOUT_OPT[@]}"} \
  --junitxml="$OUT/cuda_tests.xml" --ignore=tests/vllm_backend tests
step cuda_paths "$T_BENCH" "$PY" benchmarks/cuda_paths.py --device cuda --json "$OUT/cuda_paths.json"
step e2e "$T_E2E" "$PY" scripts/gpu_e2e.py --device cuda --steps 5 --out "$OUT"
VLLM_TIMEOUT_OPT=()  # a test builds up to two vLLM engines, one after the other
"$PY" -c "import pytest_timeout" 2>/dev/null && VLLM_TIMEOUT_OPT=(--timeout=110)
step vllm_cuda "$T_VLLM" "$PY" -m pytest -v -m cuda -rs -p no:cacheprovider ${VLLM_TIMEOUT_OPT[@]+"${VLLM_TIMEOUT_OPT[@]}"} \
  --junitxml="$OUT/vllm_cuda.xml" tests/vllm_backend

timeout "$T_SUMMARY" "$PY" - "$OUT" "${RC[cuda_tests]}" "${RC[cuda_paths]}" "${RC[e2e]}" "${RC[vllm_cuda]}" \
  "$((SECONDS - START))" <<'EOF'
import json, re, sys
from pathlib import Path
out, rc_tests, rc_bench, rc_e2e, rc_vllm, total = Path(sys.argv[1]), *map(int, sys.argv[2:7])
ok = True
def mark(good): return "PASS" if good else "FAIL"
print(f"==== gpu_check summary ({total} s) ====")
env = (out / "env.log").read_text().strip().splitlines() if (out / "env.log").exists() else []
for line in env[-3:]:
    print("  " + line[:110])
# 1. each CUDA test, from pytest -v lines ("tests/x.py::t[p] PASSED [ 10%]")
seen = {}
log = (out / "cuda_tests.log").read_text(errors="replace") if (out / "cuda_tests.log").exists() else ""
for m in re.finditer(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", log, re.M):
    seen[m.group(1)] = m.group(2)
for m in re.finditer(r"^ERROR (tests/\S+\.py)(?: |$)", log, re.M):  # a module that failed to import
    seen.setdefault(m.group(1) + " (collection)", "ERROR")
counts = {k: sum(v == k for v in seen.values()) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
print(f"cuda tests (rc {rc_tests}): " + ", ".join(f"{v} {k.lower()}" for k, v in counts.items()))
for name, status in seen.items():
    print(f"  {'PASS' if status in ('PASSED', 'XFAIL') else 'SKIP' if status == 'SKIPPED' else 'FAIL'} "
          f"{name.replace('tests/', '')[:100]}")
tests_ok = rc_tests == 0 and counts["PASSED"] > 0
ok &= tests_ok
if rc_tests in (124, 137):
    print("  FAIL (timed out: the tests after the last one listed never ran)")
# 2. each benchmark row
bench = {}
if (out / "cuda_paths.json").exists():
    bench = json.loads((out / "cuda_paths.json").read_text())
print(f"cuda_paths bench (rc {rc_bench}): {len(bench.get('rows', []))} rows")
for r in bench.get("rows", []):
    num, den = (r["ours"], r["baseline"]) if r["higher_is_better"] else (r["baseline"], r["ours"])
    print(f"  PASS {r['case']:<28} {r['metric']:<28} {r['ours']:9.4g} vs {r['baseline']:9.4g} "
          f"({num / den if den else float('inf'):.2f}x)")
if bench.get("error") or rc_bench != 0:
    print(f"  FAIL {bench.get('error', 'see cuda_paths.log')[:100]}")
ok &= rc_bench == 0 and bool(bench.get("rows"))
# 3. the end-to-end runs
runs = json.loads((out / "e2e.json").read_text()) if (out / "e2e.json").exists() else []
print(f"e2e GRPO (rc {rc_e2e}): {len(runs)} runs")
for r in runs:
    detail = (f"{r.get('steps')} steps {r.get('seconds')}s, graphs {r.get('graph_sizes')}, "
              f"{r.get('graph_replays')} replays, flash={r.get('flash_decode')}, "
              f"fp8 mm/cache={r.get('fp8_scaled_mm_layers')}/{r.get('fp8_dequant_cache_layers')}, "
              f"v{r.get('weight_version')}")
    print(f"  {mark(r.get('ok'))} {r['case']}: " + (detail if r.get("ok") else "; ".join(r.get("problems", []))[:100]))
ok &= rc_e2e == 0 and len(runs) == 2 and all(r.get("ok") for r in runs)
# 4. the vLLM backend's CUDA tests (all skipped when the image has no CUDA vLLM: not a failure)
log = (out / "vllm_cuda.log").read_text(errors="replace") if (out / "vllm_cuda.log").exists() else ""
vllm = {m.group(1): m.group(2) for m in re.finditer(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", log, re.M)}
print(f"vllm cuda tests (rc {rc_vllm}): " + ", ".join(f"{sum(v == k for v in vllm.values())} {k.lower()}"
                                                   for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")))
for name, status in vllm.items():
    print(f"  {'PASS' if status == 'PASSED' else 'SKIP' if status == 'SKIPPED' else 'FAIL'} "
          f"{name.replace('tests/', '')[:100]}")
for reason in sorted({m.group(1) for m in re.finditer(r"^SKIPPED \[\d+\] \S+: (.*)$", log, re.M)}):
    print(f"  skip reason: {reason[:100]}")
if rc_vllm in (124, 137):
    print("  FAIL (timed out: the tests after the last one listed never ran)")
ok &= rc_vllm == 0
print(f"==== {'ALL PASS' if ok else 'FAILURES (see the logs in ' + str(out) + ')'} ====")
sys.exit(0 if ok else 1)
EOF
exit $?
