"""GRPO end to end with rollout.backend=vllm: vLLM samples, the trainer trains, every
refit goes through the same protocol (verified); with rollout.free_cache_engine the engine
sleeps through every update and the refit wakes it in order; FP8 rollout in bf16."""

from __future__ import annotations

import pytest
from _vllm_helpers import SKIP_NO_VLLM, record_llm_calls

from hybridrl.config.io import load_config

pytestmark = SKIP_NO_VLLM


def _overrides(tmp_path, steps: int) -> list[str]:
    return ["rollout.backend=vllm", "model.hidden_size=64", "model.num_attention_heads=2",
            "model.num_key_value_heads=1", "model.intermediate_size=128", "rollout.n=4", "rollout.max_tokens=4",
            "batch.prompts_per_step=4", "warm_start.steps=10", "warm_start.batch_size=8",
            f"trainer.total_steps={steps}", f"trainer.eval_every={steps}", "refit.verify=true",
            "trainer.threads=2", "data.train_size=200", "data.eval_size=8", "logging.tensorboard=false",
            "logging.plot=false", "logging.progress=false", "checkpoint.save=false",
            f"trainer.output_dir={tmp_path}"]


def test_five_grpo_steps_on_vllm(tmp_path, monkeypatch):
    """Also rollout.free_cache_engine: every step samples, sleeps (sleep(1)) through the
    update, and its refit wakes the weights, reloads, then wakes the KV cache."""
    import vllm

    from hybridrl.job.loop import train

    calls = record_llm_calls(vllm.LLM, monkeypatch)
    result = train(load_config(None, _overrides(tmp_path, 5) + ["rollout.free_cache_engine=true"]))
    steps = [r for r in result.history if "reward/mean" in r]
    assert len(steps) == 5
    for r in steps:
        assert r["refit/weight_version"] == r["rollout/weight_version"] + 1
        assert r["rollout/trainer_logprob_abs_diff"] < 1e-4  # vLLM's sampling log-probs == the trainer's
    assert calls.count("sleep(1)") == 5
    for i, call in enumerate(calls):
        if call == "sleep(1)":  # the update happens here; then the refit, in this order
            assert calls[i + 1:i + 5] == ["wake_up(weights)", "reload_weights", "wake_up(kv_cache)",
                                          "reset_prefix_cache"], calls[i:i + 5]
            assert "generate" not in calls[i:i + 5]


def test_grpo_with_fp8_rollout_on_vllm(tmp_path):
    """rollout.quantization=fp8 (model.dtype=bfloat16): two verified GRPO steps, the engine's
    FP8 log-probs within FP8 tolerance of the bf16 trainer's."""
    from hybridrl.job.loop import train

    result = train(load_config(None, _overrides(tmp_path, 2) + ["rollout.quantization=fp8",
                                                                 "model.dtype=bfloat16"]))
    steps = [r for r in result.history if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["refit/weight_version"] == r["rollout/weight_version"] + 1
        assert 0 < r["rollout/trainer_logprob_abs_diff"] < 0.05  # measured 0.003


def test_vllm_backend_rejects_what_it_cannot_do():
    from hybridrl.config import ConfigError

    for quantization in ("fp8_block", "mxfp4"):
        with pytest.raises(ConfigError, match="built-in-engine only"):
            load_config(None, ["rollout.backend=vllm", f"rollout.quantization={quantization}"])
    with pytest.raises(ConfigError, match="model.dtype=bfloat16"):
        load_config(None, ["rollout.backend=vllm", "rollout.quantization=fp8"])
    load_config(None, ["rollout.backend=vllm", "rollout.quantization=fp8", "model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="rollout.backend=vllm"):
        load_config(None, ["rollout.free_cache_engine=true"])
    with pytest.raises(ConfigError, match="one rank"):
        load_config(None, ["rollout.backend=vllm", "launcher.nproc_per_node=2"])
