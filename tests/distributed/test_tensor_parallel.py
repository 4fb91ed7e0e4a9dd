"""Tensor-parallel built-in engine on 2 real ranks (gloo) vs the same engine whole: logits,
greedy and seeded sampled tokens for dense (KV heads split and replicated), MoE and
DeepSeek-V3 (MLA) models; each rank's weights are about half."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

import _tp_workers


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("family", ["qwen2", "llama_kv1", "qwen2_moe", "deepseek_v3", "deepseek_v4"])
def test_tp2_engine_equals_the_whole_engine(tmp_path, family):
    out = str(tmp_path / "tp")
    mp.spawn(_tp_workers.engine_equality, args=(2, _port(), family, out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for r in ranks:
        # fp32: only the order of the sums differs; 1e-5 relative to the largest logit (~20 here)
        assert r["logit_gap"] <= 1e-5 * max(1.0, r["logit_scale"]), (r["logit_gap"], r["logit_scale"])
        assert r["greedy_equal"] and r["sampled_equal"]
        assert r["logprob_gap"] < 1e-5, r["logprob_gap"]
        # weights per rank: half of every split layer; the norms, routers (and MLA's
        # down-projections; V4's shared KV head, compressors, indexer and hyper-connections, a
        # larger share at this tiny width) stay whole
        bound = 0.66 if family == "deepseek_v4" else 0.62
        assert r["bytes_sharded"] <= bound * r["bytes_whole"], (r["bytes_sharded"], r["bytes_whole"])
        # LoRA adapters in the TP layout (column-parallel B rows, row-parallel A columns added
        # before the all-reduce) sample what the whole engine's adapters sample
        assert r["lora_targets"] > 0 and r["lora_sampled_equal"] and r["lora_logprob_gap"] < 1e-5, r
        if family == "qwen2":  # KV heads split: half the cache; replicated (kv1) / latent (MLA): all of it
            assert r["kv_sharded"] * 2 == r["kv_whole"]
    from hybridrl.distributed.plan import engine_bytes

    cfg = _tp_workers.tp_config(family)  # `hybridrl plan` reads the same engine layers on meta: the same bytes
    assert engine_bytes(cfg, dtype=torch.float32, quantization=None, tensor_parallel_size=2) == ranks[0]["bytes_sharded"]
    assert engine_bytes(cfg, dtype=torch.float32, quantization=None) == ranks[0]["bytes_whole"]
    assert ranks[0]["tokens"] == ranks[1]["tokens"]  # the group samples one sequence per request


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe", "deepseek_v3"])
def test_tp2_engine_on_cuda_equals_the_whole_engine(tmp_path, family):
    """One GPU: both ranks on it over gloo (eager). Two GPUs: NCCL, CUDA graphs captured
    around the decode step's all-reduces / all-gathers (replayed for the whole generation)."""
    device = "cuda_nccl" if torch.cuda.device_count() >= 2 else "cuda_gloo"
    out = str(tmp_path / "tp")
    mp.spawn(_tp_workers.engine_equality, args=(2, _port(), family, out, device), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for r in ranks:
        assert r["logit_gap"] <= 1e-4 * max(1.0, r["logit_scale"]), (r["logit_gap"], r["logit_scale"])  # fp32 on the GPU: looser, its kernels differ by shape
        assert r["greedy_equal"] and r["sampled_equal"]
        assert r["graphs"] == (device == "cuda_nccl")
    assert ranks[0]["tokens"] == ranks[1]["tokens"]


@pytest.mark.parametrize("arch", ["qwen2", "deepseek_v3", "deepseek_v4", "deepseek_v3_lora"])
def test_training_at_world_2_with_tp2_matches_one_process(tmp_path, monkeypatch, arch):
    """FSDP2 over 2 ranks, one TP=2 engine between them (refit FSDP shards -> TP shards,
    verified), against one process with a whole engine: the same rollouts, losses and first
    gradients, and final weights within AdamW's bound (``_same_training`` derives each; a
    fixed tolerance on weights after Adam fails where a gradient at the rounding floor is
    normalized into an lr-sized step, e.g. DeepSeek-V4's ``hc_attn_fn`` on a Zen 5 host).
    ``_lora``: FSDP2-sharded LoRA adapters (the reference = the base), adapter-only refits
    into the TP shards, and the adapters compared at the end."""
    from _same_training import assert_same_training
    from test_data_parallel import LOSSES, _rows, train_in_process, train_subprocess

    # one-digit sums and a longer warm start: some rewards are non-zero; the entropy bonus and
    # the KL term make every step move the weights whatever the rewards
    extra = ["trainer.total_steps=3", "data.num_digits=1", "warm_start.steps=150", "warm_start.lr=3e-3",
             "algo.policy_loss.entropy_coeff=0.01", "algo.kl.coef=0.05"]
    if arch.endswith("_lora"):
        arch = arch.removesuffix("_lora")
        extra += ["model.lora.rank=4", "optim.lr=3e-3"]
    extra += [f"model.arch={arch}", "rollout.routing_replay=true"] if arch != "qwen2" else []
    assert train_in_process(tmp_path, "one", extra, monkeypatch) == 0
    two = train_subprocess(tmp_path, "two", extra + ["launcher.nproc_per_node=2", "rollout.tensor_parallel_size=2"],
                           record=True)
    assert two.returncode == 0, two.stderr[-3000:]
    assert any(r.get("reward/mean") for r in _rows(tmp_path / "one"))
    assert_same_training(tmp_path, "one", "two", losses=LOSSES)


def test_fsdp_to_tp_refit_peak_is_one_bucket_plus_a_tp_slice(tmp_path, monkeypatch):
    # large blocks from mmap, returned at free: the high-water mark shows this refit's buffers
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    bucket, out = 4 << 20, str(tmp_path / "mem")
    mp.spawn(_tp_workers.tp_refit_memory, args=(2, _port(), bucket, out), nprocs=2, join=True)
    for r in (torch.load(f"{out}.{k}") for k in range(2)):
        assert r["version"] == 4  # the verified refit and the three measured ones all committed
        assert r["peak"] <= bucket + r["largest"] // 2, r
        assert r["peak"] < r["total"] // 4, r  # never near the model (or this rank's half of it)


@pytest.mark.parametrize("overrides, match", [
    (["launcher.nproc_per_node=3", "batch.prompts_per_step=6", "rollout.tensor_parallel_size=2"],
     r"tensor_parallel_size=2 does not divide the 3 ranks"),
    (["rollout.tensor_parallel_size=2"], r"tensor_parallel_size=2 needs as many ranks; the launcher starts 1"),
    (["launcher.nproc_per_node=4", "batch.prompts_per_step=4", "rollout.tensor_parallel_size=2",
      "rollout.backend=vllm"], r"rollout.backend=vllm on 4 ranks runs one vLLM engine over all of them"),
    (["rollout.tensor_parallel_size=0"], r"rollout.tensor_parallel_size"),
])
def test_bad_tensor_parallel_configs_fail_in_one_line(overrides, match):
    from hybridrl.config import ConfigError
    from hybridrl.config.io import load_config

    from hybridrl.pipeline.engines import check_engine_choice

    with pytest.raises(ConfigError, match=match) as err:  # at config load, or by the engine factory
        check_engine_choice(load_config(None, overrides))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kw, size, quant, match", [
    (dict(num_attention_heads=6, num_key_value_heads=2), 4, None, r"num_attention_heads=6 does not split 4 ways"),
    (dict(num_attention_heads=6, num_key_value_heads=3), 2, None, r"num_key_value_heads=3 can neither be split"),
    (dict(intermediate_size=90), 4, None, r"intermediate_size=90 does not split 4 ways"),
    (dict(), 2, "fp8", r"quantization=fp8 \(per-channel scales\)"),
    (dict(), 2, "fp8_block", r"fp8_block needs the q rows per rank \(32\) to be a multiple of 128"),
])
def test_models_the_engine_cannot_split_fail_before_anything_is_built(kw, size, quant, match):
    import transformers

    from hybridrl.rollout.layers.tensor_parallel import check_tensor_parallel

    cfg = transformers.Qwen2Config(**{**dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2), **kw})
    with pytest.raises(ValueError, match=match) as err:
        check_tensor_parallel(cfg, size, quant)
    assert "\n" not in str(err.value)


def test_deepseek_v4_groups_that_do_not_split_fail_in_one_line():
    import transformers

    from hybridrl.rollout.layers.tensor_parallel import check_tensor_parallel

    cfg = transformers.DeepseekV4Config(vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                        head_dim=32, q_lora_rank=16, o_groups=1, o_lora_rank=16,
                                        moe_intermediate_size=32)
    with pytest.raises(ValueError, match=r"o_groups=1 does not split 2 ways") as err:
        check_tensor_parallel(cfg, 2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("quantization", ["fp8_block+mxfp4"])
def test_quantized_shards_hold_the_unsharded_values(tmp_path, quantization):
    out = str(tmp_path / "q")
    mp.spawn(_tp_workers.quantized_shards, args=(2, _port(), quantization, out), nprocs=2, join=True)
    for r in (torch.load(f"{out}.{k}") for k in range(2)):
        assert r["compared"] > 20 and r["unequal"] == [], r["unequal"]
        assert r["greedy_equal"]
