"""Smoke test of benchmarks/rollout_vllm.py: its RL-job case runs and reports well-formed rows."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

from _vllm_helpers import SKIP_NO_VLLM

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
pytestmark = SKIP_NO_VLLM


def test_rl_job_rows():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_rollout_vllm", BENCH / "rollout_vllm.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        common = sys.modules["_common"]
    finally:
        sys.path.remove(str(BENCH))
    rows = bench.bench_rl_job(repeats=1, warm=1)
    assert [(r["case"], r["metric"]) for r in rows] == [
        ("rl job 32x8 T<=8", "rollouts/s"), ("rl job model", "refit s"), ("rl job model", "refit s")]
    for r in rows:
        assert set(r) == set(common.ROW_KEYS) and math.isfinite(r["ours"]) and r["ours"] > 0 and r["baseline"] > 0
