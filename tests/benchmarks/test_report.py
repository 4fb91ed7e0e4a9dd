"""benchmarks/report.py's table on synthetic JSON (nothing is run, nothing is timed), and
the JSON envelope that _common.write_json writes."""

from __future__ import annotations

import json

import pytest

from _bench_module import load_bench

MACHINE = {"cpu": "Test CPU 9000", "cores": 2, "torch_cpu_capability": "AVX512", "torch_threads": 2, "gpu": None,
           "memcpy_gbps": 12.5, "torch": "2.13.0", "transformers": "5.19.0", "trl": None, "vllm": None,
           "python": "3.11.9", "date": "2026-01-02T03:04:05+00:00"}


def _row(case, metric, ours, baseline, higher, name="base"):
    return {"case": case, "metric": metric, "ours": ours, "baseline": baseline, "baseline_name": name,
            "higher_is_better": higher}


def _result(name, rows, error=None, load=(0.25, 1.5)):
    data = {"machine": MACHINE, "load": {"before": load[0], "after": load[1]}, "rows": rows}
    return {"name": name, "rc": 0 if error is None else 1, "seconds": 1.0, "json": data if rows else None,
            "error": error, "load": {"before": 9.0, "after": 9.0}}


def _lines(table, first_cell):
    return [ln for ln in table.splitlines() if ln.startswith(f"| {first_cell} |")]


def test_ratio_is_oriented_so_above_one_means_ours_is_better():
    report = load_bench("report")
    rows = [_row("c", "step s", 1.0, 4.0, False), _row("c", "tok/s", 8.0, 2.0, True),
            _row("c", "slower s", 2.0, 1.0, False), _row("c", "fewer tok/s", 1.0, 2.0, True)]
    table = report.build_table([_result("bench", rows)], MACHINE)
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in _lines(table, "bench")]
    assert [c[1:3] for c in cells] == [["c", r["metric"]] for r in rows]
    assert [c[6] for c in cells] == ["4.00x", "4.00x", "0.50x", "0.50x"]
    assert [c[3:6] for c in cells][0] == ["1", "4", "base"]
    assert all(c[7] == "0.25 → 1.5" for c in cells)  # the load from the script's own JSON


def test_failed_script_is_a_row_and_the_rest_stays():
    report = load_bench("report")
    results = [_result("masks", [_row("B=1", "seconds", 1.0, 2.0, False)]),
               _result("step", [], error="exit 1: ModuleNotFoundError: No module named 'trl'"),
               _result("packing", [_row("x", "MiB", 3.0, 6.0, False)])]
    table = report.build_table(results, MACHINE)
    (failed,) = _lines(table, "step")
    assert "**FAILED**" in failed and "No module named 'trl'" in failed
    assert "9 → 9" in failed  # no JSON: report.py's own load measurement
    assert len(_lines(table, "masks")) == len(_lines(table, "packing")) == 1
    assert "1 failed (step)" in table


def test_partial_rows_then_the_error():
    report = load_bench("report")
    res = _result("cuda_paths", [_row("bf16 b=1", "ms", 1.0, 2.0, False)], error="exit 1: TimeoutError: terminated")
    lines = _lines(report.build_table([res], MACHINE), "cuda_paths")
    assert len(lines) == 2 and "2.00x" in lines[0] and "**FAILED**" in lines[1]


def test_machine_header_and_columns():
    report = load_bench("report")
    table = report.build_table([_result("masks", [_row("a|b", "s", 1.0, 1.0, False)])], MACHINE,
                               command="python benchmarks/report.py --only masks")
    head = table.splitlines()
    assert head[0] == "# Benchmarks, 2026-01-02T03:04:05+00:00"
    assert "Test CPU 9000, 2 cores" in table and "AVX512" in table and "memcpy 12.5 GB/s" in table
    assert "torch 2.13.0" in table and "trl —" in table and "`python benchmarks/report.py --only masks`" in table
    header = next(ln for ln in head if ln.startswith("| benchmark |"))
    assert [c.strip() for c in header.strip("|").split("|")] == list(report.COLUMNS)
    assert "a\\|b" in _lines(table, "masks")[0]  # a pipe in a cell does not split it


def test_error_line_picks_the_exception():
    report = load_bench("report")
    out = "step 1\nTraceback (most recent call last):\n  File x\nValueError: bad size\nshutting down\n"
    assert report.error_line(out, 1) == "exit 1: ValueError: bad size"
    assert report.error_line("just text\n\n", 2) == "exit 2: just text"


def test_step_breakdown_needs_the_phase_rows():
    report = load_bench("report")
    rows = [_row("8x4", f"{p} s", v, 2 * v, False, "trl") for p, v in
            (("step", 1.0), ("rollout", 0.5), ("reward", 0.1), ("update", 0.3))]
    b = report.step_breakdown(rows)
    assert b["ours"]["other"] == pytest.approx(0.1) and b["baseline"]["rollout"] == 1.0 and b["baseline_name"] == "trl"
    assert report.step_breakdown(rows[:2]) is None and report.step_breakdown([]) is None


def test_write_json_envelope(tmp_path, monkeypatch):
    common = load_bench("_common")
    monkeypatch.setenv("HYBRIDRL_BENCH_LOAD_BEFORE", "0.75")
    rows = [common.row(case="c", metric="s", ours=1.0, baseline=2.0, baseline_name="b", higher_is_better=False)]
    path = tmp_path / "out.json"
    common.write_json(str(path), rows)
    data = json.loads(path.read_text())
    assert data["rows"] == rows and data["load"]["before"] == 0.75 and "after" in data["load"]
    m = data["machine"]
    assert m["cores"] >= 1 and m["memcpy_gbps"] > 0 and m["torch"] and "date" in m and "vllm" in m


def test_run_script_failure_and_stale_json(tmp_path, monkeypatch):
    report = load_bench("report")
    scripts, out = tmp_path / "benchmarks", tmp_path / "out"
    scripts.mkdir(), out.mkdir()
    (scripts / "boom.py").write_text("print('started')\nraise ValueError('boom at size 3')\n")
    (out / "boom.json").write_text(json.dumps({"rows": [_row("old", "s", 1.0, 1.0, False)]}))  # another run's
    monkeypatch.setattr(report, "HERE", scripts)
    for var in ("HYBRIDRL_BENCH_LOAD_BEFORE", "HYBRIDRL_BENCH_LOAD_WAITED_S"):
        monkeypatch.setenv(var, "0")  # restored after the test
    res = report.run_script("boom", out, quick=True, timeout_s=120, max_wait_s=0, per_core=0.5)
    assert res["rc"] == 1 and res["json"] is None and res["error"] == "exit 1: ValueError: boom at size 3"
    assert not (out / "boom.json").exists() and "started" in (out / "boom.log").read_text()
    assert "old" not in report.build_table([res], MACHINE)
