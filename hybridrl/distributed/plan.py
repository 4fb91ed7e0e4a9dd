"""``hybridrl plan``: per-device memory of a data-parallel job, from the real sharding code.

The model is built on the meta device (no memory, no download) and sharded with the same
``shard_model`` the trainer uses, inside a fake process group of the requested world size
(``torch.distributed``'s ``fake`` backend: collectives are no-ops, sharding math is real).
Each rank's share is then read off the DTensor shards — not re-derived by a formula:

- trainer: parameters, gradients (same dtype and sharding), AdamW's two moments (float32)
- engine: the built-in engine's own model built on the meta device for the largest rank of
  its tensor-parallel group (``rollout.tensor_parallel_size``; 1 = the full model), so
  every tensor it registers counts: weights in the rollout dtype, FP8 codes + scales and
  the dequantized derived caches, MXFP4 blocks + scales + cache; KV cache for the rows the
  group serves (its ranks' responses) over this rank's KV heads
- refit: one bucket + the largest parameter (the sharded refit's bound), or with tensor
  parallelism one bucket + this rank's slice of the largest parameter (FSDP -> TP refit)

Activations are not included (they depend on micro-batch size and checkpointing): the
headroom left is what they may use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.rollout.core.memory import weight_bytes  # the engine's own count, also imported from here

GiB = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    world_size: int
    params: int  # bytes per device
    grads: int
    optimizer: int
    engine_weights: int
    kv_cache: int
    refit: int
    tensor_parallel_size: int = 1

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.engine_weights + self.kv_cache + self.refit

    def table(self, device_gib: float | None = None) -> str:
        T = self.tensor_parallel_size
        engine = "engine weights (full model)" if T == 1 else f"engine weights (TP shard, 1/{T})"
        refit = "refit bucket + largest param" if T == 1 else "refit bucket + its TP slice"
        rows = [("trainer parameters (shard)", self.params), ("gradients (shard)", self.grads),
                ("AdamW moments (shard, fp32)", self.optimizer), (engine, self.engine_weights),
                ("KV cache", self.kv_cache), (refit, self.refit), ("total", self.total)]
        layout = "" if T == 1 else f", generation as {self.world_size // T} x TP {T}"
        lines = [f"per device, {self.world_size} data-parallel ranks{layout}:"]
        lines += [f"  {name:<32}{b / GiB:>10.3f} GiB" for name, b in rows]
        if device_gib is not None:
            fits = self.total <= device_gib * GiB
            lines.append(f"  {'fits ' + str(device_gib) + ' GiB?':<32}{'yes' if fits else 'NO':>10}"
                         f"  (headroom {(device_gib * GiB - self.total) / GiB:.2f} GiB for activations)")
        return "\n".join(lines)


def sharded_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of this rank's parameter shards, bytes of the largest full parameter)."""
    from torch.distributed.tensor import DTensor

    local, largest = 0, 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        local += t.numel() * t.element_size()
        largest = max(largest, p.numel() * p.element_size())
    return local, largest


def engine_bytes(hf_config, *, dtype: torch.dtype, quantization: str | None, tensor_parallel_size: int = 1) -> int:
    """Bytes of one rank's rollout-engine weights: the built-in engine's model built on the
    meta device (no memory used) as tensor-parallel rank 0 (the largest share) of its group,
    counted by the engine's own ``rollout/core/memory.py`` (what its build-time check counts)."""
    return weight_bytes(_meta_engine_model(hf_config, dtype, quantization, tensor_parallel_size))


def _rank0(tensor_parallel_size: int):
    from hybridrl.rollout.layers.tensor_parallel import TensorParallel

    T = tensor_parallel_size
    return TensorParallel(0, T, group=object() if T > 1 else None)  # the group is never used


def _meta_engine_model(hf_config, dtype, quantization, tensor_parallel_size: int):
    from hybridrl.rollout.engine import build_model
    from hybridrl.rollout.model_config import parse_hf_config

    return build_model(parse_hf_config(hf_config), quantization, 2, dtype, torch.device("meta"),
                       _rank0(tensor_parallel_size))


def kv_cache_bytes(hf_config, *, batch: int, seq_len: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """The engine's static cache for ``batch`` rows of ``seq_len`` (MLA: its latent, not per
    head; DeepSeek-V4: its state) on one rank; with tensor parallelism over that rank's KV
    heads (split, or one replicated head; MLA's latent is whole on every rank). The shapes
    are the engine's own (``rollout/core/memory.py``)."""
    from hybridrl.rollout.core.kv_cache import rank_kv_heads
    from hybridrl.rollout.core.memory import EngineMemory
    from hybridrl.rollout.model_config import parse_hf_config

    cfg = parse_hf_config(hf_config)
    memory = EngineMemory(config=cfg, dtype=dtype, weights=0, kv_heads=rank_kv_heads(cfg, _rank0(tensor_parallel_size)))
    return batch * memory.cache_row(seq_len)


@dataclass(frozen=True, kw_only=True)
class EngineLoad:
    """What one rank's rollout engine is planned to hold."""

    dtype: torch.dtype
    """the engine's weight and activation dtype."""
    quantization: str | None = None
    """the engine's weight quantization (None, "fp8", ...)."""
    batch: int
    """one rank's rows (a tensor-parallel group's engine serves ``batch x tensor_parallel_size``)."""
    seq_len: int
    """prompt + response tokens of one row."""
    tensor_parallel_size: int = 1
    """ranks of a generation group (1: every rank holds the whole model)."""


def plan_memory(hf_config, *, world_size: int, trainer_dtype: torch.dtype, bucket_bytes: int,
                engine: EngineLoad) -> MemoryPlan:
    """Shard a meta-device copy of the model over a fake group of ``world_size`` ranks (the
    trainer's share in ``trainer_dtype``), count ``engine`` and a refit of ``bucket_bytes``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    from hybridrl.distributed.fsdp import shard_model

    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=trainer_dtype)
        shard_model(model)
        local, largest = sharded_bytes(model)
        moments = 2 * sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()) * 4
    finally:
        if owns_group:
            dist.destroy_process_group()
    T = engine.tensor_parallel_size
    return MemoryPlan(world_size=world_size, params=local, grads=local, optimizer=moments,
                      engine_weights=engine_bytes(hf_config, dtype=engine.dtype, quantization=engine.quantization,
                                                  tensor_parallel_size=T),
                      kv_cache=kv_cache_bytes(hf_config, batch=engine.batch * T, seq_len=engine.seq_len,
                                              dtype=engine.dtype, tensor_parallel_size=T),
                      refit=bucket_bytes + -(-largest // T), tensor_parallel_size=T)


# Published Qwen2.5 shapes, built in code (no download) for planning.
QWEN25_SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


# Published DeepSeek-V3-family shapes (MLA + DeepSeekMoE; the MTP layer is not part of the plan).
DEEPSEEK_SHAPES = {
    "moonlight-16b-a3b": dict(hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
                              num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                              n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, n_group=1,
                              topk_group=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
                              qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=163840,
                              routed_scaling_factor=2.446),
    "deepseek-v3": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
                        num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, first_k_dense_replace=3,
                        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                        v_head_dim=128, vocab_size=129280, routed_scaling_factor=2.5),
}


def shape_config(name: str):
    from transformers import DeepseekV3Config, Qwen2Config

    if name in DEEPSEEK_SHAPES:
        return DeepseekV3Config(max_position_embeddings=32768, num_mtp_layers=0, **DEEPSEEK_SHAPES[name])
    if name not in QWEN25_SHAPES:
        from hybridrl.did_you_mean import suggest

        raise ValueError(f"--shape {name!r} is unknown; {suggest(name, {**QWEN25_SHAPES, **DEEPSEEK_SHAPES})}")
    return Qwen2Config(max_position_embeddings=32768, **QWEN25_SHAPES[name])
