"""trainer.mode=async with rollout.backend=vllm: the rollout worker process runs its own
vLLM engine, refit through shared memory (verified); requests in flight at a refit go on
under the new weights, so batches mix versions within the staleness bound."""

from __future__ import annotations

from _vllm_helpers import SKIP_NO_VLLM

from hybridrl.config.io import load_config

pytestmark = SKIP_NO_VLLM


def test_async_grpo_on_a_vllm_worker(tmp_path):
    from hybridrl.job.loop import train

    overrides = ["rollout.backend=vllm", "model.hidden_size=64", "model.num_attention_heads=2",
                 "model.num_key_value_heads=1", "model.intermediate_size=128", "rollout.n=4", "rollout.max_tokens=4",
                 "batch.prompts_per_step=4", "warm_start.steps=10", "warm_start.batch_size=8",
                 "trainer.total_steps=4", "trainer.eval_every=4", "refit.verify=true", "trainer.threads=1",
                 "data.train_size=200", "data.eval_size=8", "eval.k=0", "logging.tensorboard=false",
                 "logging.plot=false", "logging.progress=false", "checkpoint.save=false",
                 f"trainer.output_dir={tmp_path}", "trainer.mode=async", "pipeline.max_staleness=1"]
    steps = [r for r in train(load_config(None, overrides)).history if "reward/mean" in r]
    assert len(steps) == 4
    assert all(r["async/staleness_max"] <= 1 for r in steps) and max(r["async/staleness_max"] for r in steps) == 1
    assert steps[0]["async/staleness_max"] == 0
    assert steps[0]["rollout/trainer_logprob_abs_diff"] < 1e-4  # the worker's vLLM == the trainer, same weights
