"""Smoke test of benchmarks/scaling.py: one interleaved step of 1 rank and of 2 ranks (gloo),
timed by the wall clock around the whole step; the JSON carries the machine stamp and load."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from _bench_module import BENCH


def test_interleaved_wall_clock_steps_and_json(tmp_path):
    out = tmp_path / "scaling.json"
    proc = subprocess.run([sys.executable, str(BENCH / "scaling.py"), "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "interleaved steps each (12)" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data) >= {"machine", "load", "rows"} and data["load"]["before"] is not None
    rows = {r["metric"]: r for r in data["rows"]}
    assert set(rows) == {"collective share of step", "step s (wall)", "refit s"}
    assert 0 < rows["collective share of step"]["ours"] < 1
    assert all(math.isfinite(r["ours"]) and r["ours"] > 0 and r["baseline"] > 0 for r in data["rows"])
    assert "contention, not scaling" in rows["step s (wall)"]["baseline_name"] or data["machine"]["cores"] > 2
    for line in proc.stdout.splitlines():  # the wall clock includes what the phase timers see
        if "per step: wall" in line:
            walls, phases = line.split("wall ")[1].split(" s; phase timers ")
            assert all(float(w) >= float(p) for w, p in zip(walls.split(), phases.removesuffix(" s").split()))
