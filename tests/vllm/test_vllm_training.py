"""GRPO end to end with rollout.backend=vllm: vLLM samples, the trainer trains, every
refit goes through the same protocol (verified)."""

from __future__ import annotations

import pytest
from _vllm_helpers import SKIP_NO_VLLM

from hybridrl.config_io import load_config

pytestmark = SKIP_NO_VLLM


def test_five_grpo_steps_on_vllm(tmp_path):
    from hybridrl.trainer.loop import train

    cfg = load_config(None, [
        "rollout.backend=vllm", "model.hidden_size=64", "model.num_attention_heads=2", "model.num_key_value_heads=1",
        "model.intermediate_size=128", "rollout.n=4", "rollout.max_tokens=4", "trainer.prompts_per_step=4",
        "trainer.sft_steps=10", "trainer.sft_batch_size=8", "trainer.total_steps=5", "trainer.eval_every=5",
        "trainer.refit_verify=true", "trainer.threads=2", "data.train_size=200", "data.eval_size=8",
        "logging.tensorboard=false", "logging.plot=false", "logging.progress=false",
        "trainer.save_checkpoint=false", f"trainer.output_dir={tmp_path}"])
    result = train(cfg)
    steps = [r for r in result.history if "reward/mean" in r]
    assert len(steps) == 5
    for r in steps:
        assert r["refit/weight_version"] == r["rollout/weight_version"] + 1
        assert r["rollout/trainer_logprob_abs_diff"] < 1e-4  # vLLM's sampling log-probs == the trainer's


def test_vllm_backend_rejects_what_it_cannot_do():
    from hybridrl.config import ConfigError

    with pytest.raises(ConfigError, match="built-in-engine only"):
        load_config(None, ["rollout.backend=vllm", "rollout.quantization=fp8"])
    with pytest.raises(ConfigError, match="one rank"):
        load_config(None, ["rollout.backend=vllm", "trainer.nproc_per_node=2"])
