"""Smoke test of benchmarks/cuda_paths.py on CPU: the eager and refit rows it can run here."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cuda_paths.py"


def test_cpu_rows_and_json(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--device", "cpu", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["case"] for r in rows} >= {"bf16 refit", "fp8 refit", "fp8_block refit", "bf16 b=1", "fp8 b=16"}
    for r in rows:
        assert r["ours"] > 0 and r["baseline"] > 0
