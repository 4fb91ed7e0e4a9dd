"""Tensor-parallel rollout workers (``torch.multiprocessing.spawn``, gloo, CPU): each rank
builds the same HF model, a whole engine (the reference, TP=1) and its TP=2 shard, loads
both with a verified refit, and records what the test compares."""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers

from _workers import finish, init

VOCAB = 97  # odd: the last rank's vocabulary share is padded


def tp_config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=64, tie_word_embeddings=False)
    if family == "qwen2":  # q/k/v bias, 2 KV heads split over 2 ranks
        return transformers.Qwen2Config(**common, intermediate_size=96, num_key_value_heads=2)
    if family == "llama_kv1":  # 1 KV head, replicated on both ranks; tied head over a padded vocabulary
        return transformers.LlamaConfig(**{**common, "tie_word_embeddings": True}, intermediate_size=96,
                                        num_key_value_heads=1)
    if family == "qwen2_moe":  # experts + a gated shared expert, one dense layer
        return transformers.Qwen2MoeConfig(**common, intermediate_size=96, num_key_value_heads=2,
                                           moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                           shared_expert_intermediate_size=48, mlp_only_layers=[1])
    if family == "deepseek_v3":  # MLA (q-LoRA) + DeepSeekMoE with the grouped router
        return transformers.DeepseekV3Config(**common, intermediate_size=96, num_key_value_heads=4,
                                             kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
                                             qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1,
                                             n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                             moe_intermediate_size=32, n_shared_experts=1, num_mtp_layers=0)
    if family == "deepseek_v4":  # every layer type, hash + top-k routers, 2 hyper-connection streams
        return transformers.DeepseekV4Config(
            vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            head_dim=32, partial_rotary_factor=0.5, q_lora_rank=24, o_groups=2, o_lora_rank=16, hc_mult=2,
            sliding_window=8, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe"], index_n_heads=16, index_head_dim=16, index_topk=2,
            n_routed_experts=4, num_experts_per_tok=2, num_nextn_predict_layers=0, scoring_func="sigmoid",
            swiglu_limit=10.0, tie_word_embeddings=False, max_position_embeddings=512)
    raise KeyError(family)


def hf_model(cfg, seed: int = 0):
    """Weights large enough that logits are far from uniform (greedy not degenerate)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "e_score_correction_bias" in name:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 0.12))
        g = torch.Generator().manual_seed(seed)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):  # DeepSeek-V4's hash layers: every token its own k distinct experts
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                                     for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
    return model.eval()


def engine_bytes(engine) -> int:
    from hybridrl.distributed.plan import weight_bytes

    return weight_bytes(engine.model)


def engine_equality(rank: int, world: int, port: int, family: str, out: str, device: str = "cpu") -> None:
    """``device``: "cpu" (gloo); "cuda_gloo" (both ranks on one GPU, gloo, eager); "cuda_nccl"
    (a GPU per rank, NCCL, CUDA graphs captured around the decode step's collectives)."""
    import os

    from hybridrl.refit import refit_from_model
    from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
    from hybridrl.rollout.layers.tensor_parallel import TensorParallel

    if device == "cuda_nccl":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
    else:
        init(rank, world, port)
    on = "cpu" if device == "cpu" else "cuda"
    cfg = tp_config(family)
    model = hf_model(cfg).to(on)
    spec = EngineSpec(max_batch_size=64, max_seq_len=32, device=on)
    eager = device != "cuda_nccl"
    whole = RolloutEngine(cfg, spec, enforce_eager=eager)
    sharded = RolloutEngine(cfg, spec, enforce_eager=eager,
                            tensor_parallel=TensorParallel(rank, world, dist.group.WORLD))
    refit_from_model(whole, model, verify=True)
    refit_from_model(sharded, model, verify=True)  # each rank takes its slices; the verifier checks them

    gen = torch.Generator().manual_seed(11)  # the same draw on every rank
    ids = torch.randint(0, VOCAB, (6, 20), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding on two rows: the masked full-sequence path
    mask[4, :9] = 0
    ids, mask = ids.to(on), mask.to(on)
    ref = whole.runner.logits(ids, mask)[mask.bool()]
    logit_gap = float((ref - sharded.runner.logits(ids, mask)[mask.bool()]).abs().max())

    lengths = torch.randint(3, 13, (64,), generator=gen).tolist()
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    sampled = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=5)
    g_whole, g_sharded = whole.generate(prompts, greedy), sharded.generate(prompts, greedy)
    s_whole, s_sharded = whole.generate(prompts[:16], sampled), sharded.generate(prompts[:16], sampled)
    result = dict(
        logit_gap=logit_gap, logit_scale=float(ref.abs().max()),
        greedy_equal=g_whole.response_token_ids == g_sharded.response_token_ids,
        sampled_equal=s_whole.response_token_ids == s_sharded.response_token_ids,
        logprob_gap=float((s_whole.logprobs - s_sharded.logprobs).abs().max()),
        graphs=sharded.runner.graphs is not None,
        tokens=g_sharded.response_token_ids + s_sharded.response_token_ids,
        bytes_whole=engine_bytes(whole), bytes_sharded=engine_bytes(sharded),
        kv_whole=sum(t.numel() * t.element_size() for _, t in whole.runner.kv_cache.named_tensors()),
        kv_sharded=sum(t.numel() * t.element_size() for _, t in sharded.runner.kv_cache.named_tensors()),
    )
    if device == "cpu":
        result.update(lora_equality(model, cfg, spec, TensorParallel(rank, world, dist.group.WORLD), prompts[:16],
                                    sampled))
    torch.save(result, f"{out}.{rank}")
    finish()


def lora_equality(model, cfg, spec, tp, prompts, sampled) -> dict:
    """LoRA adapters (rank 4, B drawn: the same on every rank) applied by a TP shard vs the
    whole engine, loaded with verified full refits and then a verified adapter-only refit."""
    import copy
    import dataclasses

    from hybridrl.config import LoRAConfig
    from hybridrl.lora import apply_lora
    from hybridrl.refit import refit_from_model
    from hybridrl.rollout import RolloutEngine
    from hybridrl.rollout.layers.lora_adapter import AdapterSpec

    lora = apply_lora(copy.deepcopy(model), rank=4, alpha=8.0, dropout=0.0, target_modules=LoRAConfig().target_modules)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in lora.layers.values():
            w = layer.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    spec = dataclasses.replace(spec, lora=AdapterSpec(lora.rank, lora.scale, tuple(lora.targets)))
    whole, shard = RolloutEngine(cfg, spec, enforce_eager=True), RolloutEngine(cfg, spec, enforce_eager=True,
                                                                               tensor_parallel=tp)
    for engine in (whole, shard):
        refit_from_model(engine, lora.refit_tensors("adapter", full=True), verify=True)
        refit_from_model(engine, lora.refit_tensors("adapter", full=False), verify=True, partial=True)
    a, b = whole.generate(prompts, sampled), shard.generate(prompts, sampled)
    return dict(lora_sampled_equal=a.response_token_ids == b.response_token_ids,
                lora_logprob_gap=float((a.logprobs - b.logprobs).abs().max()), lora_targets=len(lora.targets))


def tp_refit_memory(rank: int, world: int, port: int, bucket: int, out: str) -> None:
    """FSDP(2) -> TP(2) refit (verified first), then the peak extra resident memory of one refit."""
    from _workers import small_model

    from hybridrl.distributed.fsdp import shard_model
    from hybridrl.distributed.tp_refit import refit_sharded_tp
    from hybridrl.refit.memory import peak_rss_delta
    from hybridrl.rollout import EngineSpec, RolloutEngine
    from hybridrl.rollout.layers.tensor_parallel import TensorParallel

    init(rank, world, port)
    model = small_model(hidden=512, vocab=4096, layers=4)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = RolloutEngine(model.config, EngineSpec(max_batch_size=2, max_seq_len=16), enforce_eager=True,
                           tensor_parallel=TensorParallel(rank, world, dist.group.WORLD))
    shard_model(model)
    refit_sharded_tp(engine, model, bucket_bytes=bucket, verify=True)
    peak = min(peak_rss_delta(lambda: refit_sharded_tp(engine, model, bucket_bytes=bucket)) for _ in range(3))
    torch.save(dict(peak=peak, largest=largest, total=total, version=engine.weight_version), f"{out}.{rank}")
    finish()


def quantized_shards(rank: int, world: int, port: int, quantization: str, out: str) -> None:
    """Each TP rank's quantized weights (dequantized, as the verifier reads them) vs the same
    slice of the whole engine's: block-FP8 tiles and MXFP4 blocks quantized per shard must give
    the unsharded scales and codes exactly."""
    from hybridrl.refit import refit_from_model
    from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
    from hybridrl.rollout.layers.tensor_parallel import TensorParallel, take_local

    init(rank, world, port)
    # every shard owns whole 128x128 tiles (q/k/v rows, o_proj and MLP columns per rank = 128)
    # and whole 32-blocks (the experts' width per rank = 32)
    cfg = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=256, moe_intermediate_size=64,
                                      num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=256,
                                      mlp_only_layers=[1], max_position_embeddings=64, tie_word_embeddings=False)
    model = hf_model(cfg)
    spec = EngineSpec(max_batch_size=8, max_seq_len=24, quantization=quantization)
    whole = RolloutEngine(cfg, spec, enforce_eager=True)
    shard = RolloutEngine(cfg, spec, enforce_eager=True, tensor_parallel=TensorParallel(rank, world, dist.group.WORLD))
    refit_from_model(whole, model, verify=True)
    refit_from_model(shard, model, verify=True)
    unequal, compared = [], 0
    for route in shard.weight_routes:
        ref = take_local(whole.weight_routes[route.hf_name].held(), route.shape, route.tp)
        compared += 1
        if not torch.equal(route.held(), ref):
            unequal.append(route.hf_name)
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    same = whole.generate(prompts, greedy).response_token_ids == shard.generate(prompts, greedy).response_token_ids
    torch.save(dict(unequal=unequal, compared=compared, greedy_equal=same), f"{out}.{rank}")
    finish()
