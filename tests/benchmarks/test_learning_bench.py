"""Smoke test of benchmarks/learning.py: our side's clocked curve (no TRL needed) and the
headline arithmetic (time to target, bounds, ratio)."""

from __future__ import annotations

import math

from _bench_module import load_bench

TINY = ["model.hidden_size=32", "model.num_hidden_layers=1", "model.num_attention_heads=2",
        "model.num_key_value_heads=1", "model.intermediate_size=64", "data.train_size=64", "data.eval_size=8",
        "batch.prompts_per_step=2", "rollout.n=2", "rollout.max_tokens=4", "warm_start.steps=2",
        "warm_start.batch_size=4"]


def test_our_side_curve_at_clock_checkpoints(tmp_path):
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
        side = bench.OursSide(run, evaluate, bench.Curve(budget=0.3, every=0.1, warm_acc=warm))
        side.run_until(10.0)  # stops at the budget, not at the requested clock
    finally:
        run.log.close()
        run.step.scorer.close()
        if hasattr(run, "directory"):
            run.directory.close()
    times = [t for t, _, _ in side.curve.points]
    assert times == [0.0, 0.1, 0.2, 0.3] or [round(t, 6) for t in times] == [0.0, 0.1, 0.2, 0.3]
    assert side.curve.done() and side.clock >= 0.3 and side.steps >= 1
    steps = [s for _, _, s in side.curve.points]
    assert steps == sorted(steps) and steps[-1] == side.steps
    assert all(0.0 <= a <= 1.0 for _, a, _ in side.curve.points)
    assert evaluate.seconds > 0


def test_headline_target_and_ratio():
    bench = load_bench("learning")
    ours = [(0, 0.2, 0), (30, 0.6, 100), (60, 0.9, 200), (90, 0.95, 300)]
    trl = [(0, 0.2, 0), (30, 0.3, 40), (60, 0.5, 80), (90, 0.7, 120)]
    h = bench.headline(ours, trl, budget=90)
    assert h["target"] == 0.7 and h["ours"] == 60 and h["trl"] == 90 and h["ratio"] == 1.5 and h["bound"] == ""
    # TRL better than 80%: the target is capped at 80%
    trl_hi = [(0, 0.2, 0), (30, 0.85, 40), (60, 0.9, 80), (90, 0.9, 120)]
    h = bench.headline(ours, trl_hi, budget=90)
    assert h["target"] == 0.8 and h["ours"] == 60 and h["trl"] == 30 and h["ratio"] == 0.5
    # ours never reaches TRL's best: ours counts as the budget, the ratio is an upper bound
    h = bench.headline([(0, 0.2, 0), (30, 0.3, 10), (60, 0.4, 20)], [(0, 0.2, 0), (30, 0.5, 5), (60, 0.6, 9)],
                       budget=60)
    assert h["bound"] == "<=" and h["ours"] == 60 and h["trl"] == 60 and h["ratio"] == 1.0
    # TRL never improves on the warm start: the target is our best (capped), TRL never reaches it
    h = bench.headline(ours[:2], [(0, 0.2, 0), (30, 0.1, 5)], budget=30)
    assert h["target"] == 0.6 and h["ours"] == 30 and h["trl"] == 30 and h["bound"] == ">=" and h["ratio"] == 1.0
    # neither side improves: no ratio
    h = bench.headline([(0, 0.2, 0), (30, 0.2, 5)], [(0, 0.2, 0), (30, 0.1, 5)], budget=30)
    assert math.isnan(h["ratio"]) and h["ours"] is None
    # the start (t = 0) never counts as reaching the target
    assert bench.time_to(ours, 0.2) == 30
    assert bench.time_to(ours, 0.95) == 90 and bench.time_to(ours, 0.99) is None
    assert "ours acc" in bench.side_by_side(ours, trl)
