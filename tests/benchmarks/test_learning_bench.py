"""Smoke test of benchmarks/learning.py: our side's step-clocked curve at evaluation steps
(no TRL needed), the interpolated crossings, the targets over seeds, the rows and the plot.
Synthetic step times, no wall-clock thresholds."""

from __future__ import annotations

import json
import math

import pytest

from _bench_module import load_bench

TINY = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
        "model.num_key_value_heads=1", "model.intermediate_size=64", "data.train_size=64", "data.eval_size=8",
        "batch.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=4", "warm_start.steps=2",
        "warm_start.batch_size=4"]


def _side(bench, step_s: float, accs: dict[int, float], steps: int):
    """A Side with constant step seconds and accuracy at the given steps (0: warm start)."""
    side = bench.Side(accs[0])
    side.step_s = [step_s] * steps
    side.evals += [(k, a) for k, a in sorted(accs.items()) if k > 0]
    return side


def _result(bench, seed, ours, trl):
    return bench.SeedResult(seed=seed, warm_acc=ours.evals[0][1], sft_s=0.0, ours=ours, trl=trl,
                            trl_name="TRL x.y GRPOTrainer, gradient checkpointing off")


def test_our_side_steps_and_evaluations(tmp_path):
    bench = load_bench("learning")
    from hybridrl.job.build import build_run
    from hybridrl.job.loop import warm_start

    cfg = bench.bench_config(threads=1, output_dir=str(tmp_path), overrides=TINY)
    run = build_run(cfg, console=lambda s: None)
    try:
        warm_start(run, cfg)
        evaluate = bench.Evaluator(run)
        warm = evaluate(run.policy)
        assert 0.0 <= warm <= 1.0
        ours = bench.OursSide(run, warm)
        steps, every = 5, 2
        for k in range(1, steps + 1):
            ours.step()
            if bench.eval_due(k, every, steps):
                ours.side.evals.append((k, evaluate(run.policy)))
    finally:
        run.log.close()
        run.step.scorer.close()
        if hasattr(run, "directory"):
            run.directory.close()
    side = ours.side
    assert side.steps == 5 and all(s > 0 for s in side.step_s)
    pts = side.points()
    assert [k for k, _, _ in pts] == [0, 2, 4, 5]
    secs = [t for _, t, _ in pts]
    assert secs[0] == 0.0 and secs == sorted(secs) and math.isclose(secs[-1], side.seconds())
    assert math.isclose(secs[1], side.step_s[0] + side.step_s[1])
    assert all(0.0 <= a <= 1.0 for _, _, a in pts)
    assert evaluate.seconds > 0


def test_crossing_interpolates_the_first_crossing():
    bench = load_bench("learning")
    xs, ys = [0, 10, 20, 30], [0.2, 0.6, 0.9, 0.5]
    assert bench.crossing(xs, ys, 0.4) == pytest.approx(5.0)
    assert bench.crossing(xs, ys, 0.8) == pytest.approx(10 + 10 * 0.2 / 0.3)
    assert bench.crossing(xs, ys, 0.9) == pytest.approx(20.0)  # reached exactly at an evaluation
    assert bench.crossing(xs, ys, 0.2) == 0.0  # already at the start
    assert bench.crossing(xs, ys, 0.95) is None
    # a dip below the target after crossing it does not move the crossing
    assert bench.crossing([0, 1, 2, 3], [0.0, 1.0, 0.0, 1.0], 0.5) == pytest.approx(0.5)


def test_reach_in_seconds_and_steps():
    bench = load_bench("learning")
    side = _side(bench, 0.5, {0: 0.5, 10: 0.7, 20: 0.9}, steps=20)
    t, s, ok = bench.reach(side, 0.8)
    assert ok and s == pytest.approx(15.0) and t == pytest.approx(7.5)  # 15 steps x 0.5 s
    t, s, ok = bench.reach(side, 0.95)
    assert not ok and t == pytest.approx(10.0) and s == 20.0  # never: its whole run


def test_absolute_targets_medians_and_bounds():
    bench = load_bench("learning")
    # ours: 0.1 s/step, TRL: 0.3 s/step; same accuracy per step (the algorithms agree), except
    # that TRL never reaches 90% in seed 1
    acc = {0: 0.5, 10: 0.7, 20: 0.85, 30: 0.95}
    acc_trl_low = {0: 0.5, 10: 0.7, 20: 0.85, 30: 0.88}
    results = [_result(bench, 0, _side(bench, 0.1, acc, 30), _side(bench, 0.3, acc, 30)),
               _result(bench, 1, _side(bench, 0.1, acc, 30), _side(bench, 0.3, acc_trl_low, 30))]
    targets = bench.choose_targets(results)
    assert [t.label for t in targets] == ["70%", "80%", "90%"]
    t70, t80, t90 = targets
    assert t70.ours_s == pytest.approx([1.0, 1.0]) and t70.trl_s == pytest.approx([3.0, 3.0])
    assert t80.ours_steps == pytest.approx([10 + 10 / 1.5] * 2) and t80.trl_steps == t80.ours_steps
    assert t80.bound == "" and t80.case() == "time to 80%"
    assert t90.trl_missed == 1 and t90.ours_missed == 0 and t90.bound == ">="
    assert t90.trl_s[1] == pytest.approx(9.0)  # missed: TRL's whole run
    assert "TRL missed it in 1/2 seeds" in t90.case()
    line = bench.target_line(t80, results)
    assert "3.00x" in line and "TRL/ours 1.00x" in line and "per-step time TRL/ours 3.00x" in line

    rows = bench.build_rows(results, targets)
    common = load_bench("_common")
    for r in rows:
        assert set(r) == set(common.ROW_KEYS) and math.isfinite(r["ours"]) and math.isfinite(r["baseline"])
        assert r["baseline_name"].startswith("TRL x.y")
    by = {(r["case"], r["metric"]): r for r in rows}
    assert by[("time to 80%", "seconds, median of 2 seeds")]["baseline"] == pytest.approx(3 * by[
        ("time to 80%", "seconds, median of 2 seeds")]["ours"])
    assert by[("30 steps", "s/step, median of 2 seeds")]["ours"] == pytest.approx(0.1)
    assert [r["case"] for r in rows if r["metric"].startswith("held-out")] == ["step 10", "step 20", "step 30"]
    json.dumps({"rows": rows}, allow_nan=False)  # valid JSON: no inf / nan


def test_relative_targets_when_the_absolute_ones_are_out_of_reach():
    bench = load_bench("learning")
    ours = _side(bench, 0.1, {0: 0.1, 4: 0.2, 8: 0.3}, 8)
    trl = _side(bench, 0.2, {0: 0.1, 4: 0.15, 8: 0.2}, 8)
    flat = _side(bench, 0.1, {0: 0.1, 4: 0.1, 8: 0.1}, 8)
    results = [_result(bench, 0, ours, trl), _result(bench, 1, flat, flat)]  # seed 1: no gain: left out
    targets = bench.choose_targets(results)
    assert [t.label for t in targets] == ["50% of the gain", "80% of the gain", "90% of the gain"]
    half = targets[0]
    assert half.seeds == [0] and half.levels == pytest.approx([0.15])  # half way to the lower best (0.2)
    assert half.ours_steps == pytest.approx([2.0]) and half.trl_steps == pytest.approx([4.0])
    assert half.ours_s == pytest.approx([0.2]) and half.trl_s == pytest.approx([0.8])
    # neither side improves anywhere: no target at all
    assert bench.choose_targets([_result(bench, 0, flat, flat)]) == []


def test_accuracy_table_and_plot(tmp_path):
    bench = load_bench("learning")
    acc = {0: 0.5, 3: 0.6, 6: 0.8}
    results = [_result(bench, s, _side(bench, 0.1 + s / 100, acc, 6), _side(bench, 0.2, acc, 6)) for s in range(2)]
    table = bench.accuracy_table(results)
    assert "ours acc" in table and "TRL acc" in table and len(table.splitlines()) == 4
    png = tmp_path / "curve.png"
    bench.plot(results, bench.choose_targets(results), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
