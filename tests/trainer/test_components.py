"""The typed components wired by ``build_run``: presets reach the loss, weight versions
are checked, every phase is timed by the step's one timer."""

from __future__ import annotations

import random
import time

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
    run.step.start(random.Random(0), 1)
    run.step()
    assert calls and set(calls) == {("gspo", 3e-4, 4e-4, "seq-mean-token-mean")}


def test_rollouts_carry_the_version_they_were_sampled_with(tmp_path):
    """The batch source decides the weight version: a sync step's rollouts carry the version
    it published last (build_run's first load), and the step's publication is the next one,
    which the trainer's engine then records."""
    run = _run(tmp_path, [])
    step = run.step
    published = step.source.version
    assert published == step.rollout.engine.weight_version > 0
    taken, take = [], step.source.take
    step.source.take = lambda model: taken.append(take(model)) or taken[-1]
    step.start(random.Random(1), 1)
    m = step()
    assert taken[0].step_batch.rollouts.response_versions() == {published} and not taken[0].stale
    assert m["rollout/weight_version"] == published
    assert m["refit/weight_version"] == published + 1 == step.source.version == step.rollout.engine.weight_version
    assert {f"time/{p}_s" for p in ("rollout", "log_probs", "advantages", "update", "refit")} <= set(m)
    assert "time/reward_s" not in m  # scoring overlaps generation inside "rollout"


def test_training_on_rollouts_of_other_weights_fails_loudly(tmp_path):
    """An engine refit behind the source's back (so the sampling weights are not the version
    the step will train) is caught before the update by the staleness check at
    max_staleness 0 (sync's on-policy check), not trained on silently."""
    run = _run(tmp_path, [])
    step = run.step
    step.start(random.Random(2), 1)
    step.rollout.push(run.policy, 99)  # behind the source's back: the engine now samples as version 99
    weights = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
    with pytest.raises(ValueError, match="staleness bound broken"):
        step()
    assert all((p == weights[n]).all() for n, p in run.policy.named_parameters())  # nothing was trained


def test_groups_are_scored_as_they_finish_and_equal_the_two_phase_step(tmp_path):
    """The source hands each group to its scoring thread as soon as the group's n samples
    finished, while later groups still decode (the engine keeps stepping during the reward
    call); tokens, log-probs and scores equal sampling everything in one call, then scoring it."""
    import dataclasses
    import threading
    from collections import Counter

    import torch

    run = _run(tmp_path, ["rollout.max_tokens=24"])
    step, worker, source = run.step, run.step.rollout, run.step.source
    engine, t = worker.engine, step.train_set
    rows, seeds = step._draw(random.Random(3))  # step 1's prompts when the source starts on Random(3)
    prompts = [t.prompts[r] for r in rows]
    n = worker.sampling.n
    # stop on a token this model samples now and then, so groups finish at different steps
    counts = Counter(tok for r in worker.sample(prompts, seeds).response_token_ids for tok in r)
    total = sum(counts.values())
    stop = min(counts, key=lambda tok: abs(counts[tok] / total - 0.08))
    worker.sampling = source.task.sampling = dataclasses.replace(worker.sampling, stop_token_ids=(stop,))

    handed, scored = [], []  # per group: engine busy at hand-over; (thread, steps before, steps after)
    hand_over, score = source._score, source.task.score

    def handing(group):
        handed.append(engine.has_unfinished_requests())
        hand_over(group)

    def scoring(row, outputs):
        runner = source.producers[0].runner
        before = runner.engine_steps
        if not scored:  # the first finished group: is the engine stepped while its reward runs?
            deadline = time.monotonic() + 30
            while runner.engine_steps == before and engine.has_unfinished_requests() and time.monotonic() < deadline:
                time.sleep(0.001)
        scored.append((threading.current_thread().name, before, runner.engine_steps))
        return score(row, outputs)

    source._score, source.task.score = handing, scoring
    step.start(random.Random(3), 1)
    batch = source.take(step.actor.model)
    streamed = batch.step_batch
    assert streamed.batch_idx == rows
    assert len(handed) == len(scored) == len(rows) and any(handed)  # handed over mid-generation
    assert all(name.startswith("reward") for name, _, _ in scored)  # on the source's scoring thread
    assert scored[0][2] > scored[0][1]  # later groups decoded while the first one was scored

    plain = worker.sample(prompts, seeds)
    answers = [t.answers[r] for r in rows for _ in range(n)]
    texts = [t.prompt_texts[r] for r in rows for _ in range(n)]
    plain_scores = torch.tensor(step.scorer.score(plain.response_token_ids, answers, texts).scores)
    a, b = streamed.rollouts, plain
    assert a.response_token_ids == b.response_token_ids
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(streamed.raw_scores.cpu(), plain_scores.float())
    assert a.response_versions() == {source.version} == {worker.version}
