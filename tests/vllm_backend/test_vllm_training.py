"""GRPO end to end with rollout.backend=vllm: vLLM samples, the trainer trains, every
refit goes through the same protocol (verified); with rollout.free_cache_engine the engine
sleeps through every update and the refit wakes it in order; FP8 rollout in bf16."""

from __future__ import annotations

import pytest
from _vllm_helpers import SKIP_NO_VLLM, record_llm_calls

from hybridrl.config.base import ConfigError
from hybridrl.config.io import load_config
from hybridrl.pipeline.engines import check_engine_choice

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


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_lora_refits_reach_vllm(tmp_path, mode):
    """model.lora on vLLM: after the first (full) load every refit is partial — the merged
    targeted weights (merged: reloaded) or A/B only (adapter: a new LoRARequest id) — and
    verified; vLLM's sampling log-probs stay the trainer's (a refit that left old weights or
    the old adapter in place would not)."""
    from hybridrl.job.loop import train

    result = train(load_config(None, _overrides(tmp_path, 3) + [
        "model.lora.rank=4", "model.lora.init=gaussian", f"rollout.lora_mode={mode}", "optim.lr=3e-2",
        "model.lora.target_modules=[q_proj,k_proj,v_proj,down_proj]"]))
    steps = [r for r in result.history if "reward/mean" in r]
    assert len(steps) == 3
    for r in steps:
        assert r["refit/weight_version"] == r["rollout/weight_version"] + 1
        assert r["rollout/trainer_logprob_abs_diff"] < 1e-4
    # layers x rank x (in + out of q, k, v, down) x fp32: A [r, in] and B [out, r] only
    adapter_bytes = 2 * 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (128 + 64)) * 4
    if mode == "adapter":  # every step's refit sends A/B only
        assert [r["refit/bytes"] for r in steps] == [adapter_bytes] * 3
    if mode == "merged":
        return
    with pytest.raises(ConfigError, match="splits vLLM's fused q_proj/k_proj/v_proj"):
        check_engine_choice(load_config(None, _overrides(tmp_path, 1) + [
            "model.lora.rank=4", "rollout.lora_mode=merged", "model.lora.target_modules=[q_proj,v_proj]"]))


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
    with pytest.raises(ConfigError, match="model.dtype=bfloat16"):  # the backend's limit, before anything is built
        check_engine_choice(load_config(None, ["rollout.backend=vllm", "rollout.quantization=fp8"]))
    check_engine_choice(load_config(None, ["rollout.backend=vllm", "rollout.quantization=fp8", "model.dtype=bfloat16"]))
    with pytest.raises(ConfigError, match="rollout.backend=vllm"):
        load_config(None, ["rollout.free_cache_engine=true"])
    with pytest.raises(ConfigError, match=r"set rollout.tensor_parallel_size=2"):
        check_engine_choice(load_config(None, ["rollout.backend=vllm", "launcher.nproc_per_node=2"]))


@pytest.mark.parametrize("lora", [[], ["model.lora.rank=4", "model.lora.init=gaussian", "optim.lr=3e-2"]],
                         ids=["full", "lora-adapter"])
def test_two_ranks_with_one_vllm_tp2_engine_train_what_one_process_trains(tmp_path, lora):
    """launcher.nproc_per_node=2 rollout.tensor_parallel_size=2: vLLM's external_launcher in the
    two trainer processes (a shard each), refit from the FSDP2 shards (gathered per bucket,
    vLLM's loaders keep their partition; verified), against one process with a whole vLLM engine.
    With LoRA (adapter mode): the adapters gathered from their shards, each rank's vLLM slots
    holding its slice."""
    import json
    import os
    import subprocess
    import sys

    def run(name, extra):
        cmd = [sys.executable, "-m", "hybridrl", "train", *_overrides(tmp_path, 2), *extra,
               "data.num_digits=1", "warm_start.steps=150", "warm_start.lr=3e-3", "algo.policy_loss.entropy_coeff=0.01",
               "trainer.threads=1", f"trainer.run_name={name}", *lora]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    one = run("one", [])
    two = run("two", ["launcher.nproc_per_node=2", "rollout.tensor_parallel_size=2"])
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        assert a.get("reward/mean") == b.get("reward/mean")
        for key in ("actor/pg_loss", "actor/entropy"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])


def test_doctor_mismatch_on_a_vllm_job(tmp_path):
    """hybridrl doctor on rollout.backend=vllm: the total gap from vLLM's own sampled log-probs
    (fp32: rounding), the causes it cannot switch off said so in one line each, the exact
    recommendation naming the backend switch it needs, the report written."""
    from hybridrl.doctor.run import doctor_mismatch

    cfg = load_config(None, _overrides(tmp_path, 1) + ["warm_start.steps=100", "batch.prompts_per_step=8"])
    d, out = doctor_mismatch(cfg, str(tmp_path / "doc"), console=lambda line: None)
    assert d.total["tokens"] > 20 and 0 <= d.total["kl"] < 1e-8
    by = {c.name: c for c in d.causes}
    assert by["quantization"].effect_kl is None and "vLLM backend" in by["quantization"].note
    assert any(r.startswith("rollout.exact=true rollout.backend=builtin:") for r in d.recommendations)
    assert sorted(p.name for p in out.iterdir()) == ["mismatch.json", "mismatch.png", "mismatch.txt"]
