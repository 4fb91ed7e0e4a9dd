"""The actor's policy-gradient on a real RL batch equals an independent float64
re-computation: every row through the plain Hugging Face forward, one at a time,
``log_softmax`` at the sampled tokens, the loss aggregated by hand.

This guards the whole update path at once (micro-batching, the shared-prefix forward,
masks, the alignment of advantages with rows and tokens, loss aggregation), the part a
silent bug would turn into "RL does not learn"."""

from __future__ import annotations

import random

import pytest
import torch

from _tiny import TINY_MODEL, sampled_batch

from hybridrl.config.io import load_config
from hybridrl.job.build import build_run
from hybridrl.job.loop import warm_start


def _reference_loss(model, batch, mode: str) -> torch.Tensor:
    ids, am, rm, adv = batch["input_ids"], batch["attention_mask"], batch["response_mask"], batch["advantages"]
    per_row = []
    for i in range(ids.shape[0]):
        n = int(am[i].sum())  # right padding: the row's tokens are its first n
        logits = model(input_ids=ids[i:i + 1, :n]).logits[0].double()
        logp = torch.log_softmax(logits[:-1], -1).gather(1, ids[i, 1:n, None])[:, 0]  # token t+1's log-prob
        m, a = rm[i, 1:n].double(), adv[i, 1:n].double()
        per_row.append((-(a * logp * m).sum(), m.sum()))
    if mode == "token-mean":
        return sum(s for s, _ in per_row) / sum(c for _, c in per_row)
    assert mode == "seq-mean-token-mean"
    return sum(s / c for s, c in per_row) / len(per_row)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("shared_prefix", [True, False])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_actor_gradient_equals_float64_reference(tmp_path, shared_prefix, mode):
    seed = random.randrange(1 << 20)
    cfg = load_config(None, TINY_MODEL + [
        f"trainer.seed={seed}", "warm_start.steps=30", "trainer.total_steps=1", "trainer.threads=1",
        "data.train_size=200", "data.eval_size=8", "batch.prompts_per_step=8", "optim.grad_clip=1e9",
        f"batch.shared_prefix={str(shared_prefix).lower()}", f"algo.loss_agg_mode={mode}",
        "logging.tensorboard=false", f"trainer.output_dir={tmp_path}", "checkpoint.save=false"])
    run = build_run(cfg, console=lambda s: None)
    try:
        warm_start(run, cfg)
        step = run.step
        sb = sampled_batch(step, seed, random_advantages=True)
        actor = step.actor
        actor.optimizer.step = lambda *a, **k: None  # keep the weights: compare the gradient only
        batch = sb.update_batch()
        actor._mini_batch_step(dict(batch))
        ours = torch.cat([p.grad.flatten() for p in actor.model.parameters()]).double()
        actor.model.zero_grad(set_to_none=True)
        _reference_loss(actor.model, batch, mode).backward()
        ref = torch.cat([p.grad.flatten() for p in actor.model.parameters()]).double()
        assert ref.norm() > 0
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()))
    finally:
        run.step.close()
        run.step.scorer.close()
        run.directory.close()


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_the_worst_token_gap_is_reported_not_only_the_mean(tmp_path):
    """``rollout/trainer_logprob_abs_diff`` is a token mean: a few tokens off by a nat hide in
    it. ``..._max`` is the worst token: one token's sampling log-prob moved by 1 nat shows as
    1 there (the engine and trainer agree to ~1e-6 elsewhere)."""
    seed = random.randrange(1 << 20)
    cfg = load_config(None, TINY_MODEL + [
        f"trainer.seed={seed}", "warm_start.steps=0", "trainer.total_steps=1", "trainer.threads=1",
        "data.train_size=50", "data.eval_size=4", "batch.prompts_per_step=4", "logging.tensorboard=false",
        f"trainer.output_dir={tmp_path}", "checkpoint.save=false"])
    run = build_run(cfg, console=lambda s: None)
    try:
        step = run.step
        batch = dict(sampled_batch(step, seed).update_batch())
        assert "rollout_log_prob" in batch
        step.actor.optimizer.step = lambda *a, **k: None  # the same weights for both passes
        clean = step.actor._mini_batch_step(dict(batch))
        tokens = batch["response_mask"].bool().nonzero()
        row, col = tokens[torch.randint(len(tokens), (1,))][0].tolist()
        batch["rollout_log_prob"] = batch["rollout_log_prob"].clone()
        batch["rollout_log_prob"][row, col] -= 1.0
        moved = step.actor._mini_batch_step(dict(batch))
        assert clean["rollout/trainer_logprob_abs_diff_max"] < 1e-4, (seed, clean)
        assert abs(moved["rollout/trainer_logprob_abs_diff_max"] - 1.0) < 1e-3, (seed, moved)
        assert moved["rollout/trainer_logprob_abs_diff"] < 0.5, (seed, moved)  # the mean hides it
    finally:
        run.step.close()
        run.step.scorer.close()
        run.directory.close()
