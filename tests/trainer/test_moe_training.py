"""A Qwen3-MoE policy trained end to end: transformers on the trainer side, the engine's
fused-expert MoE on the rollout side (bf16-free, float32: the log-prob gap is rounding)."""

from __future__ import annotations

import pytest

from hybridrl.config.io import load_config


def _moe_checkpoint(tmp_path):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hybridrl.data.char_tokenizer import build_char_tokenizer
    from hybridrl.checkpoint.atomic import save_checkpoint_atomic

    tok = build_char_tokenizer()
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    return save_checkpoint_atomic(Qwen3MoeForCausalLM(cfg), tok, tmp_path / "moe")


@pytest.mark.parametrize("quantization", [None, "mxfp4"])
def test_grpo_on_a_moe_policy(tmp_path, quantization):
    from hybridrl.job.loop import train

    ckpt = _moe_checkpoint(tmp_path)
    rows = "".join('{"prompt": "%d+%d=", "answer": "%d"}\n' % (a, b, a + b) for a in range(10, 30) for b in range(3))
    (tmp_path / "train.jsonl").write_text(rows)
    cfg = load_config(None, [f"model.path={ckpt}", f"data.train_files=[{tmp_path / 'train.jsonl'}]",
                             "data.eval_size=4", "rollout.n=4", "rollout.max_tokens=4", "batch.prompts_per_step=4",
                             "trainer.total_steps=2", "trainer.eval_every=2", "refit.verify=true",
                             f"rollout.quantization={'null' if quantization is None else quantization}",
                             "logging.tensorboard=false", "logging.plot=false", "logging.progress=false",
                             "checkpoint.save=false", f"trainer.output_dir={tmp_path}"])
    result = train(cfg)
    steps = [r for r in result.history if "reward/mean" in r]
    assert len(steps) == 2 and all(r["refit/weight_version"] == r["rollout/weight_version"] + 1 for r in steps)
    if quantization is None:  # float32 engine == float32 trainer, up to rounding
        assert all(r["rollout/trainer_logprob_abs_diff_max"] < 1e-4 for r in steps)


def test_routing_replay_and_router_loss_in_training(tmp_path):
    """With MXFP4 experts the engine's expert choices differ from the float32 trainer's;
    replaying them closes most of the log-prob gap. The router loss is logged and finite."""
    from hybridrl.job.loop import train

    ckpt = _moe_checkpoint(tmp_path)
    rows = "".join('{"prompt": "%d+%d=", "answer": "%d"}\n' % (a, b, a + b) for a in range(10, 30) for b in range(3))
    (tmp_path / "train.jsonl").write_text(rows)
    gaps = {}
    for replay in (False, True):
        cfg = load_config(None, [f"model.path={ckpt}", f"data.train_files=[{tmp_path / 'train.jsonl'}]",
                                 "data.eval_size=4", "rollout.n=4", "rollout.max_tokens=4",
                                 "batch.prompts_per_step=8", "trainer.total_steps=1", "trainer.eval_every=1",
                                 "rollout.quantization=mxfp4", f"rollout.routing_replay={str(replay).lower()}",
                                 "algo.router_aux_loss_coef=0.01", "algo.kl.coef=0.01", "batch.ppo_epochs=2",
                                 "logging.tensorboard=false", "logging.plot=false", "logging.progress=false",
                                 "checkpoint.save=false", f"trainer.output_dir={tmp_path}",
                                 f"trainer.run_name=replay{replay}"])
        step = [r for r in train(cfg).history if "reward/mean" in r][0]
        gaps[replay] = step["rollout/trainer_logprob_abs_diff"]
        assert step["actor/router_aux_loss"] > 0
    assert gaps[True] < gaps[False], gaps


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_builtin_deepseek_models_train_with_verified_refits(tmp_path, arch):
    """model.arch=deepseek_v3 / deepseek_v4: GRPO steps with refit verification (V4: the plain
    forward, its stateful cache cannot serve the shared-prefix path; its top-k layers' routing
    recorded by the engine and replayed in the trainer)."""
    from hybridrl.job.loop import train

    cfg = load_config(None, [f"model.arch={arch}", "model.hidden_size=32", "model.num_attention_heads=2",
                             "model.intermediate_size=128", "data.train_size=64", "data.eval_size=4",
                             "warm_start.steps=2", "rollout.n=4", "rollout.max_tokens=6", "batch.prompts_per_step=4",
                             "trainer.total_steps=2", "trainer.eval_every=2", "refit.verify=true",
                             "logging.tensorboard=false", "logging.plot=false", "logging.progress=false",
                             "checkpoint.save=false", f"trainer.output_dir={tmp_path}",
                             f"rollout.routing_replay={str(arch == 'deepseek_v4').lower()}",
                             f"algo.router_aux_loss_coef={0.01 if arch == 'deepseek_v4' else 0}"])
    steps = [r for r in train(cfg).history if "reward/mean" in r]
    assert len(steps) == 2 and all(r["refit/weight_version"] == r["rollout/weight_version"] + 1 for r in steps)
    assert all(r["rollout/trainer_logprob_abs_diff_max"] < 1e-4 for r in steps)  # float32 engine == trainer
    if arch == "deepseek_v4":
        assert all(0 < r["actor/router_aux_loss"] < float("inf") for r in steps)
