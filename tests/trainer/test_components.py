"""The typed components wired by ``build_run``: presets reach the loss, weight versions
are checked, every phase is timed by the step's one timer."""

from __future__ import annotations

import random

import pytest

from hybridrl.config.io import load_config
from _tiny import TINY_MODEL

BASE = TINY_MODEL + ["warm_start.steps=0", "trainer.total_steps=1", "logging.tensorboard=false",
                     "logging.plot=false", "checkpoint.save=false", "data.train_size=200",
                     "data.eval_size=8"]


def _run(tmp_path, extra):
    from hybridrl.job.build import build_run

    cfg = load_config(None, BASE + [f"trainer.output_dir={tmp_path}"] + extra)
    return build_run(cfg, console=lambda s: None)


def test_gspo_preset_reaches_the_trainer_loss(tmp_path, monkeypatch):
    """algo.preset=gspo: the update calls GSPO with the paper's clip range and aggregation."""
    import hybridrl.algos as algos

    calls = []
    real = algos.get_policy_loss

    def spy(name):
        fn = real(name)

        def wrapped(**kw):
            calls.append((name, kw["clip"].low, kw["clip"].high, kw["aggregation"].mode))
            return fn(**kw)
        return wrapped

    monkeypatch.setattr(algos, "get_policy_loss", spy)
    run = _run(tmp_path, ["algo.preset=gspo"])
    run.step(random.Random(0))
    assert calls and set(calls) == {("gspo", 3e-4, 4e-4, "seq-mean-token-mean")}


def test_rollouts_carry_the_version_they_were_sampled_with(tmp_path):
    run = _run(tmp_path, [])
    before = run.step.rollout.expected_version
    m = run.step(random.Random(1))
    assert m["rollout/weight_version"] == before
    assert m["refit/weight_version"] == before + 1 == run.step.rollout.engine.weight_version
    assert {f"time/{p}_s" for p in ("rollout", "reward", "log_probs", "advantages", "update", "refit")} <= set(m)


def test_training_on_rollouts_of_other_weights_fails_loudly(tmp_path):
    """An engine updated outside the worker (so the sampling weights are not the ones the
    step will train) is caught before the update, not trained on silently."""
    from hybridrl.refit import refit_from_model
    from hybridrl.trainer.rollout_worker import StaleRolloutError

    run = _run(tmp_path, [])
    refit_from_model(run.step.rollout.engine, run.policy, bucket_bytes=1 << 20)  # behind the worker's back
    weights = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
    with pytest.raises(StaleRolloutError, match="weight_version"):
        run.step(random.Random(2))
    assert all((p == weights[n]).all() for n, p in run.policy.named_parameters())  # nothing was trained


def test_groups_are_scored_as_they_finish_and_equal_the_two_phase_step(tmp_path):
    """The step's rollout streams finished groups to the reward while later groups still
    decode; tokens, log-probs and scores equal sampling everything, then scoring it."""
    import torch

    from hybridrl.trainer.timer import PhaseTimer

    import dataclasses
    from collections import Counter

    run = _run(tmp_path, ["rollout.max_tokens=24"])
    step, worker = run.step, run.step.rollout
    engine = worker.engine
    # stop on a token this model samples now and then, so groups finish at different steps
    counts = Counter(t for r in step.sample(random.Random(3)).rollouts.response_token_ids for t in r)
    total = sum(counts.values())
    stop = min(counts, key=lambda t: abs(counts[t] / total - 0.08))
    worker.sampling = dataclasses.replace(worker.sampling, stop_token_ids=(stop,))
    seen_unfinished = []
    sample_groups = worker.sample_groups

    def watching(prompts, seeds, on_group):
        def handed_over(g, outputs):
            seen_unfinished.append(engine.has_unfinished_requests())
            on_group(g, outputs)
        return sample_groups(prompts, seeds, handed_over)

    worker.sample_groups = watching
    streamed = step.sample_and_score(random.Random(3), PhaseTimer(("rollout", "reward")))
    assert len(seen_unfinished) == len(streamed.batch_idx) and any(seen_unfinished)  # handed over mid-generation
    plain = step.sample(random.Random(3))
    step.score(plain)
    a, b = streamed.rollouts, plain.rollouts
    assert a.response_token_ids == b.response_token_ids
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(streamed.raw_scores, plain.raw_scores)
    assert a.response_versions() == {worker.expected_version}
