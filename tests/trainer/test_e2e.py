"""A few GRPO steps of a tiny config, end to end (seconds)."""

import json

import pytest
import torch

from hybridrl.config.io import load_config
from hybridrl.job.loop import train

from _tiny import TINY_MODEL

# mini_batch_size=8 of a 16-row batch: two optimizer steps per RL step, so the off-policy
# path (separate old-log-prob pass) runs here; test_algorithms_e2e covers on-policy.
TINY = TINY_MODEL + [
    "data.train_size=300", "data.eval_size=16", "batch.mini_batch_size=8", "warm_start.steps=5",
    "trainer.total_steps=3", "trainer.eval_every=2", "refit.verify=true",
]


def _engine_state(engine):
    return {n: t.detach().clone() for n, t in engine.model.named_parameters()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    cfg = load_config(None, TINY + [f"trainer.output_dir={out}", "trainer.run_name=e2e", "algo.kl.coef=0.01"])
    from hybridrl.job import build

    captured = {}
    real_build = build.build_run

    def spy(*a, **k):
        run = real_build(*a, **k)
        captured["run"] = run
        captured["initial"] = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
        return run

    import hybridrl.job.loop as loop
    loop.build_run = spy
    try:
        result = train(cfg)
    finally:
        loop.build_run = real_build
    return result, captured


def test_metrics_and_outputs_written(run):
    result, _ = run
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in ("reward/mean", "reward/std", "response/length_mean", "actor/kl", "actor/entropy", "actor/pg_clipfrac",
                "actor/grad_norm", "actor/lr", "time/rollout_s", "time/log_probs_s",
                "time/advantages_s", "time/update_s", "time/refit_s", "perf/tokens_per_s"):
        assert key in steps[0], key
    assert "time/reward_s" not in steps[0]  # scoring overlaps generation: timed inside time/rollout_s
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in steps[-1]
    assert (result.run_dir / "curves.png").stat().st_size > 1000
    assert (result.run_dir / "config.yaml").is_file()
    assert any((result.run_dir / "tensorboard").iterdir())
    # every rollout is attributed to the policy version that produced it
    versions = [r["rollout/weight_version"] for r in steps]
    assert versions == sorted(versions) and len(set(versions)) == 3


def test_weights_changed_and_engine_equals_actor(run):
    result, captured = run
    run = captured["run"]
    model = run.policy
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, captured["initial"][n])]
    assert len(changed) == len(captured["initial"])
    # engine logits == actor logits after the last refit (same weights, fp32)
    ids = torch.randint(4, len(run.tokenizer), (3, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits.float()
    torch.testing.assert_close(run.step.rollout.engine.logits(ids, mask), ref, rtol=1e-4, atol=1e-4)


def test_checkpoint_reloads(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result, captured = run
    ckpt = result.run_dir / "checkpoint"
    model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    assert tok.decode(tok.encode("12+3=", add_special_tokens=False)) == "12+3="
    actor = captured["run"].policy
    for (n, a), (_, b) in zip(actor.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n
