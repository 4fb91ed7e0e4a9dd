"""Smoke test of benchmarks/async.py's bookkeeping on synthetic runs (no training, no
wall-clock thresholds): steps/s, time to the sync run's accuracy, the ideal-overlap row."""

from __future__ import annotations

import argparse

from _bench_module import load_bench


def _run(bench, step_s: list[float], gen_s: list[float], evals, final: float):
    return bench.Run(step_s=step_s, generate_s=gen_s, evals=evals, final_accuracy=final)


def test_rows_from_synthetic_runs(monkeypatch) -> None:
    bench = load_bench("async")
    runs = {  # run_name -> Run: sync 0.2 s/step (0.12 generating); async 0.12 s/step
        "sync": _run(bench, [0.2] * 4, [0.12] * 4, [(2, 0.5), (4, 0.8)], 0.8),
        "one_step_off": _run(bench, [0.15] * 4, [0.0] * 4, [(2, 0.6), (4, 0.8)], 0.8),
        "async_s1": _run(bench, [0.12] * 4, [0.0] * 4, [(2, 0.79), (4, 0.81)], 0.81),
        "sync_slow0": _run(bench, [0.3] * 4, [0.2] * 4, [], 0.8),
        "async_slow0": _run(bench, [0.25] * 4, [0.0] * 4, [], 0.8),
        "async_s2": _run(bench, [0.14] * 4, [0.0] * 4, [(2, 0.7), (4, 0.8)], 0.8),
        "sync_slow1": _run(bench, [0.3] * 4, [0.2] * 4, [], 0.8),
        "async_slow1": _run(bench, [0.25] * 4, [0.0] * 4, [], 0.8),
    }
    seen = []

    def fake_train_case(overrides, out, name):
        seen.append((name, overrides))
        return runs[name]

    monkeypatch.setattr(bench, "train_case", fake_train_case)
    args = argparse.Namespace(quick=False, steps=4, eval_every=2, latency_ms=[15.0, 30.0], seed=0)
    rows = {(r["case"], r["metric"]): r for r in bench.throughput(args, "/unused")}
    case = "default job, 4 steps"
    assert rows[(case, "async s=1 steps/s")]["ours"] == 1 / 0.12 and rows[(case, "async s=1 steps/s")]["baseline"] == 5.0
    # target = sync's final accuracy - 0.02 = 0.78: async reaches it at step 2 (0.24 s), sync at step 4 (0.8 s)
    t = rows[(case, "async s=1 s to acc 0.78")]
    assert (round(t["ours"], 9), round(t["baseline"], 9)) == (0.24, 0.8)
    overlap = rows[("decode step >= 15 ms (generation 2.0x training)", "async s=1 step s (overlap)")]
    assert ("decode step >= 30 ms (generation 2.0x training)", "async s=1 steps/s") in rows
    assert overlap["ours"] == 0.25 and round(overlap["baseline"], 9) == 0.2  # max(0.2 generating, 0.1 training)
    slow = dict(seen)["sync_slow0"]
    assert "rollout.step_latency_ms=15" in slow and "trainer.mode=sync" in slow
    assert "pipeline.placement=disaggregated" in dict(seen)["async_s1"]
    quick = argparse.Namespace(quick=True, steps=4, eval_every=2, latency_ms=[15.0, 30.0], seed=0)
    metrics = [r["metric"] for r in bench.throughput(quick, "/unused")]
    assert not any("s to acc" in m for m in metrics) and len(metrics) == 4  # 2 modes + the first latency
