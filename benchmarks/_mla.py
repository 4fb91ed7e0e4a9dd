"""DeepSeek-V3's multi-head latent attention in the rollout engine (issue #31), for rollout.py.

- **KV bytes per token**, read from the engine's own allocation (``kv_cache.bytes_per_token``)
  for a DeepSeek-V3-shaped tiny model vs the Qwen2 engine of the same width (hidden, heads,
  layers): MHA (``num_kv_heads = heads``) and GQA with 4 query heads per KV head.
- **Decode tokens/s, latent-space (absorbed) vs decompress-then-attend** at 1k and 4k context:
  the same engine and requests, ``set_decode_mode`` switched between timed rounds; only
  decode steps are timed (the requests are prefilled before the clock starts).
- **Prefill tokens/s, decompressed (our choice) vs absorbed**: one 1k-token prompt per row.
- **vs HF generate** on the same config (dynamic cache: transformers caches the latent too
  and expands it through ``kv_b_proj`` at every step).

The model keeps DeepSeek-V3's ratios at toy width: 8 heads, latent 128 + rope 32, per-head
q/k nope 64 and v 64 (V3: 128 heads, 512 + 64, 128 / 128), 3 layers (1 dense, 2 MoE: a flipped
expert choice in the first MoE layer reaches later tokens through the last attention).
"""
from __future__ import annotations

import time

import torch
import transformers
from _common import engine_vs_hf_generate, interleaved_times, row

from hybridrl.refit.transport import named_trainer_tensors
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.rollout.models.deepseek_v3.mla import set_decode_mode

MLA = dict(vocab_size=512, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=3,
           num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32,
           qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
           n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=8192, num_mtp_layers=0)


def mla_model(dtype: torch.dtype, **overrides):
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**MLA, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 1.0 / p.shape[-1] ** 0.5))
    return model.to(dtype).eval()


def _engine(hf, batch: int, max_seq_len: int, dtype) -> RolloutEngine:
    engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=batch, max_seq_len=max_seq_len, dtype=dtype))
    engine.load_weights(named_trainer_tensors(hf))
    return engine


def kv_rows(dtype: torch.dtype) -> list[dict]:
    ds = RolloutEngine(transformers.DeepseekV3Config(**MLA), EngineSpec(max_batch_size=1, max_seq_len=8, dtype=dtype))
    ours = ds.runner.kv_cache.bytes_per_token
    rows = []
    for kv_heads, label in ((MLA["num_attention_heads"], "MHA"), (MLA["num_attention_heads"] // 4, "GQA 4:1")):
        cfg = transformers.Qwen2Config(vocab_size=MLA["vocab_size"], hidden_size=MLA["hidden_size"],
                                       num_hidden_layers=MLA["num_hidden_layers"],
                                       num_attention_heads=MLA["num_attention_heads"], num_key_value_heads=kv_heads,
                                       intermediate_size=MLA["intermediate_size"])
        qwen = RolloutEngine(cfg, EngineSpec(max_batch_size=1, max_seq_len=8, dtype=dtype))
        head_dim = MLA["hidden_size"] // MLA["num_attention_heads"]
        rows.append(row(case="deepseek_v3 MLA latent cache", metric="KV bytes/token", ours=ours,
                        baseline=qwen.runner.kv_cache.bytes_per_token,
                        baseline_name=f"Qwen2 engine, same width ({label}: {kv_heads} KV heads x {head_dim})",
                        higher_is_better=False))
    return rows


def _decode_seconds(engine: RolloutEngine, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return time.perf_counter() - t0


def decode_rows(hf, dtype, contexts: tuple[int, ...], batch: int, steps: int, repeats: int) -> list[dict]:
    rows = []
    for context in contexts:
        engine = _engine(hf, batch, context + (repeats * 2 + 2) * steps + 8, dtype)
        prompts = torch.randint(0, hf.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(2))
        params = SamplingParams(temperature=1.0, max_tokens=(repeats * 2 + 2) * steps + 4, seed=0)
        for i, p in enumerate(prompts.tolist()):
            engine.add_request(f"r{i}", p, params)
        engine.step()  # prefill every row (untimed)

        def run(mode):
            set_decode_mode(engine.model, mode)
            return _decode_seconds(engine, steps)

        absorbed, expanded = interleaved_times([lambda: run("absorb"), lambda: run("decompress")], repeats)
        tokens = batch * steps
        rows.append(row(case=f"deepseek_v3 decode b={batch} context {context}", metric="decode tokens/s",
                        ours=tokens / min(absorbed), baseline=tokens / min(expanded),
                        baseline_name="ours, decompress-then-attend (kv_b_proj over the cache every step)",
                        higher_is_better=True))
    return rows


def prefill_rows(hf, dtype, context: int, batch: int, repeats: int) -> list[dict]:
    engine = _engine(hf, batch, context + 1, dtype)
    ids = torch.randint(0, hf.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(3))
    lengths = torch.full((batch,), context)

    def run(mode):
        set_decode_mode(engine.model, mode, prefill=True)
        engine.runner.prefill(ids, lengths)

    expanded, absorbed = interleaved_times([lambda: run("decompress"), lambda: run("absorb")], repeats)
    set_decode_mode(engine.model, "decompress", prefill=True)
    return [row(case=f"deepseek_v3 prefill b={batch} x {context}", metric="prefill tokens/s",
                ours=batch * context / min(expanded), baseline=batch * context / min(absorbed),
                baseline_name="ours, absorbed (latent-space) prefill", higher_is_better=True)]


def hf_rows(hf, dtype, batch: int, new_tokens: int, repeats: int) -> list[dict]:
    return engine_vs_hf_generate("deepseek_v3", hf, dtype, batch, new_tokens, repeats, prompt_len=32)


def bench_mla(dtype: torch.dtype, quick: bool) -> list[dict]:
    hf = mla_model(dtype)
    rows = kv_rows(dtype)
    if quick:
        rows += decode_rows(hf, dtype, (1024, 4096), batch=2, steps=4, repeats=2)
        rows += prefill_rows(hf, dtype, 512, batch=1, repeats=2)
        rows += hf_rows(hf, dtype, 4, 16, repeats=2)
    else:
        rows += decode_rows(hf, dtype, (1024, 4096), batch=4, steps=8, repeats=3)
        rows += prefill_rows(hf, dtype, 1024, batch=2, repeats=3)
        for batch in (1, 16):
            rows += hf_rows(hf, dtype, batch, 64, repeats=3)
    return rows
