"""DeepSeek-V4 in the rollout engine (issue #32), for rollout.py.

- **KV bytes per token at 4k and 32k context**, from the engine's own allocation
  (``V4StateCache.bytes_at``: the sliding-window ring and compressor rings, constant per
  request, plus one compressed entry per ``m`` / ``M`` tokens) vs a full-attention cache of
  the same head dim over the same layers (K and V of one head of ``head_dim``, what a model
  without compression keeps: ``2 * layers * head_dim`` values per token).
- **Decode tokens/s vs HF ``generate``** (its dynamic V4 cache) on the same tiny config.

The model: a V4-Flash-shaped toy — 6 layers (2 CSA, 3 HCA, 1 sliding), head_dim 128, rope 32,
window 128, rates 4 and 128, 16 indexer heads of 64 keeping the top 64 entries, hc_mult 4.
"""
from __future__ import annotations

import torch
import transformers
from _common import engine_vs_hf_generate, row

from hybridrl.rollout import EngineSpec, RolloutEngine

TYPES = ["heavily_compressed_attention", "heavily_compressed_attention", "compressed_sparse_attention",
         "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
V4 = dict(vocab_size=512, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=len(TYPES),
          num_attention_heads=4, head_dim=128, partial_rotary_factor=0.25, q_lora_rank=128, o_groups=2,
          o_lora_rank=64, hc_mult=4, sliding_window=128,
          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
          layer_types=TYPES, mlp_layer_types=["hash_moe"] + ["moe"] * (len(TYPES) - 1), index_n_heads=16,
          index_head_dim=64, index_topk=64, n_routed_experts=8, num_experts_per_tok=2, num_nextn_predict_layers=0,
          max_position_embeddings=40000)


def v4_model(dtype: torch.dtype):
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**V4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embed" in name else p.shape[-1] ** -0.5))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(b.shape[0])]))
    return model.to(dtype).eval()


def kv_rows(dtype: torch.dtype) -> list[dict]:
    cfg = transformers.DeepseekV4Config(**V4)
    rows = []
    for context in (4096, 32768):
        engine = RolloutEngine(cfg, EngineSpec(max_batch_size=1, max_seq_len=context, dtype=dtype))
        elem = torch.empty((), dtype=dtype).element_size()
        ours = engine.runner.kv_cache.bytes_at(context) / context
        full = 2 * cfg.num_hidden_layers * cfg.head_dim * elem
        rows.append(row(case=f"deepseek_v4 state at {context // 1024}k context", metric="KV bytes/token", ours=ours,
                        baseline=full, baseline_name=f"full attention, same layers and head dim (k + v of one "
                                                     f"{cfg.head_dim}-wide head)", higher_is_better=False))
    return rows


def hf_rows(hf, dtype, batch: int, new_tokens: int, repeats: int) -> list[dict]:
    return engine_vs_hf_generate("deepseek_v4", hf, dtype, batch, new_tokens, repeats, prompt_len=64, baseline_name="hf generate (dynamic cache, eager attention)")


def bench_v4(dtype: torch.dtype, quick: bool) -> list[dict]:
    rows = kv_rows(dtype)
    hf = v4_model(dtype)
    if quick:
        rows += hf_rows(hf, dtype, 4, 16, repeats=2)
    else:
        for batch in (1, 16):
            rows += hf_rows(hf, dtype, batch, 64, repeats=3)
    return rows
