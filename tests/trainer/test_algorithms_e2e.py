"""Every advantage estimator and policy loss runs end to end on the default task (a few steps)."""

import json
import math

import pytest

from hybridrl.algos import ADV_ESTIMATORS, POLICY_LOSSES
from hybridrl.config.io import load_config
from hybridrl.job.loop import train

from _tiny import TINY_MODEL

TINY = TINY_MODEL + [
    "data.train_size=200", "data.eval_size=8", "warm_start.steps=3", "trainer.total_steps=2",
    "trainer.eval_every=2", "logging.tensorboard=false", "logging.plot=false", "checkpoint.save=false",
]


def _run(tmp_path, extra, *, must_update=True):
    cfg = load_config(None, TINY + [f"trainer.output_dir={tmp_path}", "trainer.run_name=x"] + extra)
    result = train(cfg)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        if must_update or "actor/grad_norm" in r:
            assert math.isfinite(r["actor/grad_norm"]) and math.isfinite(r["actor/pg_loss"])
    return steps


@pytest.mark.parametrize("estimator", sorted(ADV_ESTIMATORS))
def test_each_advantage_estimator_runs(tmp_path, estimator):
    steps = _run(tmp_path, [f"algo.advantage.estimator={estimator}"])
    if estimator == "gae":
        assert "critic/vf_loss" in steps[0]


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
def test_each_policy_loss_runs(tmp_path, loss):
    _run(tmp_path, [f"algo.policy_loss.name={loss}"])


def test_off_policy_corrections_and_dapo_extras_run(tmp_path):
    steps = _run(tmp_path, ["batch.mini_batch_size=8", "batch.ppo_epochs=2", "algo.correction.tis_cap=2.0",
                            "algo.correction.mismatch_seq_upper=3.0", "algo.dapo.dynamic_sampling=true", "algo.dapo.overlong_filter=true",
                            "algo.dapo.overlong_buffer_len=2", "algo.policy_loss.clip_ratio_high=0.28", "algo.kl.coef=0.01",
                            "algo.kl.use_loss=false", "algo.kl.adaptive_target=0.1", "algo.policy_loss.entropy_coeff=0.01"],
                 must_update=False)  # dynamic sampling may drop every group of an untrained model
    assert "actor/tis_ratio_mean" in steps[0] and "actor/kl_coef" in steps[0]
    assert 0.0 <= steps[0]["batch/kept_fraction"] <= 1.0


def test_dynamic_sampling_refill(tmp_path):
    steps = _run(tmp_path, ["algo.dapo.dynamic_sampling=true", "algo.dapo.refill_rounds=2",
                            "warm_start.steps=30"], must_update=False)
    for r in steps:
        assert 0 <= r["batch/refill_rounds"] <= 2
        assert 0.0 <= r["batch/kept_fraction"] <= 1.0

