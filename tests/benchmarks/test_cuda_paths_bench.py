"""Smoke test of benchmarks/cuda_paths.py on CPU: the eager and refit rows it can run here."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cuda_paths.py"


def test_cpu_rows_and_json(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--device", "cpu", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert "error" not in data
    assert {r["case"] for r in rows} >= {"bf16 refit", "fp8 refit", "fp8_block refit", "bf16 b=1", "fp8 b=16",
                                         "bf16 b=16 live=256 (sdpa)"}
    for r in rows:
        assert r["ours"] > 0 and r["baseline"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="provokes the failure of a CUDA-less torch")
def test_rows_so_far_are_written_on_an_error(tmp_path):
    """On CUDA-less torch, --device cuda fails at once: the JSON still says why, exit 1."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--device", "cuda", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "FAILED after" in proc.stderr
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["error"]


# ---- the rest of scripts/gpu_check.sh, as far as a CPU goes ---------------------------------

ROOT = BENCH.parents[1]


def test_gpu_e2e_script_runs_the_job_on_cpu(tmp_path):
    """scripts/gpu_e2e.py (the GRPO steps gpu_check runs on CUDA), tiny and on CPU."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_e2e.py"), "--device", "cpu", "--steps", "2",
                           "--tiny", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = json.loads((tmp_path / "e2e.json").read_text())
    assert [r["case"] for r in runs] == ["bf16", "fp8"] and all(r["ok"] for r in runs)
    assert runs[1]["fp8_dequant_cache_layers"] > 0  # CPU: FP8 through the dequantized cache


def test_gpu_check_summarizes_every_step_without_a_gpu(tmp_path):
    """On CPU: CUDA tests skip, the bench and e2e fail fast; the summary still lists each
    test and says FAIL, and the run is bounded by the per-step timeouts."""
    import os
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "T_TESTS": "400"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=900, env=env)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert "==== gpu_check summary" in out and "FAILURES" in out
    assert "SKIP refit/test_cuda_graph_refit.py::test_graph_replay_equals_eager_after_each_refit[fp8]" in out
    assert "FAIL" in out.split("cuda_paths bench")[1] and (tmp_path / "cuda_paths.json").exists()
    assert len(out.split("==== gpu_check summary")[1].splitlines()) < 80  # about one screen
