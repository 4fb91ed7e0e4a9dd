"""Smoke test of benchmarks/async.py's bookkeeping on synthetic runs (no training, no
wall-clock thresholds): steps/s, time to the sync run's accuracy, the ideal-overlap row; the
calculator agent rows (async vs sync, the tool time env.overlap hides) and --agent-parity."""

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


def _agent_args(**kw):
    base = dict(quick=False, seed=0, agent_steps=0, agent_warm_start=None, agent_latency_ms=[3.0],
                env_latency_ms=100.0)
    return argparse.Namespace(**{**base, **kw})


def test_agent_rows_from_synthetic_runs(monkeypatch) -> None:
    """The calculator agent rows: async vs sync steps/s, the ideal overlap, and the share of
    tool time env.overlap hides (1 - (R_ov - R_0) / (R_no - R_0))."""
    bench = load_bench("async")
    runs = {  # sync: 1.0 s/step, 0.6 generating (rollout 0.5 + reward 0.1); async 0.6 s/step
        "agent_sync": bench.Run(step_s=[1.0] * 4, generate_s=[0.6] * 4, rollout_s=[0.5] * 4, tool_calls=[0.3] * 4),
        "agent_async_s1": bench.Run(step_s=[0.6] * 4, generate_s=[0.0] * 4, rollout_s=[0.0] * 4),
        "agent_sync_no_overlap": bench.Run(step_s=[2.0] * 4, generate_s=[1.6] * 4, rollout_s=[1.5] * 4),
        "agent_sync_no_tools": bench.Run(step_s=[0.8] * 4, generate_s=[0.4] * 4, rollout_s=[0.3] * 4),
    }
    seen = {}

    def fake_train_case(overrides, out, name, config=None):
        seen[name] = (overrides, config)
        return runs[name]

    monkeypatch.setattr(bench, "train_case", fake_train_case)
    rows = {r["metric"]: r for r in bench.agent(_agent_args(), "/unused")}
    assert set(rows) == {"async s=1 steps/s", "async s=1 step s (overlap)", "rollout s/step, env.overlap=true",
                         "tool time hidden (share)"}
    steps = rows["async s=1 steps/s"]
    assert (steps["ours"], steps["baseline"]) == (1 / 0.6, 1.0) and steps["higher_is_better"]
    assert "calculator_agent.yaml" in steps["baseline_name"] and "generation 1.5x training" in steps["case"]
    overlap = rows["async s=1 step s (overlap)"]
    assert overlap["ours"] == 0.6 and overlap["baseline"] == 0.6  # max(0.6 generating, 0.4 training)
    assert (rows["rollout s/step, env.overlap=true"]["ours"], rows["rollout s/step, env.overlap=true"]["baseline"]) \
        == (0.5, 1.5)
    share = rows["tool time hidden (share)"]
    assert abs(share["ours"] - (1 - 0.2 / 1.2)) < 1e-9 and share["baseline"] == 1.0
    assert all(config.endswith("examples/calculator_agent.yaml") for _, config in seen.values())
    sync, asyn = seen["agent_sync"][0], seen["agent_async_s1"][0]
    for knob in ("rollout.step_latency_ms=3", "env.latency_ms=100", "trainer.total_steps=20", "warm_start.steps=400"):
        assert knob in sync and knob in asyn
    assert "trainer.mode=sync" in sync and "trainer.threads=0" not in sync  # the example's own trainer.threads
    assert "trainer.mode=async" in asyn and "pipeline.max_staleness=1" in asyn
    assert "env.overlap=false" in seen["agent_sync_no_overlap"][0]
    assert "env.latency_ms=0" in seen["agent_sync_no_tools"][0]
    assert "env.latency_ms=100" not in seen["agent_sync_no_tools"][0]
    # --quick: 2 RL steps from a 40-step warm start, the same four cases
    seen.clear()
    assert len(bench.agent(_agent_args(quick=True), "/unused")) == 4
    assert all("trainer.total_steps=2" in o and "warm_start.steps=40" in o for o, _ in seen.values())


def test_hidden_share() -> None:
    bench = load_bench("async")
    assert bench.hidden_share(1.0, 1.0, 0.5) == 0.0  # overlap hid nothing
    assert bench.hidden_share(0.5, 1.5, 0.5) == 1.0  # all of it
    assert bench.hidden_share(1.0, 0.5, 0.5) != bench.hidden_share(1.0, 0.5, 0.5)  # no tool time: nan


def test_shared_warm_start_reuses_the_first_weights(monkeypatch) -> None:
    """Inside shared_warm_start the first run warm-starts; later runs load its weights and
    publish them to their engines."""
    import types

    import torch

    import hybridrl.job.loop as loop

    bench = load_bench("async")
    calls = []

    def real(run, cfg):
        calls.append("real")
        with torch.no_grad():
            run.policy.weight.fill_(3.0)

    monkeypatch.setattr(loop, "warm_start", real)

    def a_run():
        published = []
        return types.SimpleNamespace(policy=torch.nn.Linear(2, 2),
                                     step=types.SimpleNamespace(source=types.SimpleNamespace(publish=published.append)),
                                     published=published)

    first, second = a_run(), a_run()
    with bench.shared_warm_start():
        loop.warm_start(first, None)
        loop.warm_start(second, None)
    assert calls == ["real"] and loop.warm_start is real
    assert torch.equal(second.policy.weight, torch.full((2, 2), 3.0)) and second.published == [second.policy]


def test_agent_parity_rows(monkeypatch, capsys) -> None:
    bench = load_bench("async")
    finals = {"agent_parity_0_sync": 0.80, "agent_parity_0_async_s1": 0.79,
              "agent_parity_1_sync": 0.90, "agent_parity_1_async_s1": 0.93}
    seen = []

    def fake_train_case(overrides, out, name, config=None):
        seen.append((name, overrides, config))
        return bench.Run(final_accuracy=finals[name])

    monkeypatch.setattr(bench, "train_case", fake_train_case)
    rows = bench.agent_parity(argparse.Namespace(agent_parity=2), "/unused")
    assert [r["metric"] for r in rows] == ["async s=1 median final acc", "async s=1 mean final acc"]
    assert abs(rows[0]["ours"] - 0.86) < 1e-9 and abs(rows[0]["baseline"] - 0.85) < 1e-9
    out = capsys.readouterr().out
    assert "seed 0: sync 0.800, async s=1 0.790, difference -1.0 points" in out and "3.0 points" in out
    assert "NOT met" in out
    assert all(c.endswith("examples/calculator_agent.yaml") for _, _, c in seen)
    assert ["trainer.seed=1", "trainer.mode=async", "pipeline.max_staleness=1"] in [o for _, o, _ in seen]
