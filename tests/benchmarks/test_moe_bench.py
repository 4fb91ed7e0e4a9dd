"""Smoke test of benchmarks/moe.py on a tiny Qwen3-MoE: the rows are well-formed, the decode
rows are rollout.py's, and the routing agreement is measured on both sides (with replay the
trainer's routers output exactly the engine's recorded experts)."""

from __future__ import annotations

import math

import torch

from _bench_module import load_bench

TINY_MOE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                head_dim=32, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2)


def test_moe_bench_rows():
    moe, common = load_bench("moe"), load_bench("_common")
    hf = common.moe_model(**TINY_MOE)
    rows = moe.bench_decode(hf, 2, 2, 1)
    assert [(r["case"], r["metric"], r["baseline_name"]) for r in rows] == [
        ("moe b=2 T=2", "tokens/s", "hf generate (dynamic cache)")]
    rows = moe.bench_gap(hf, "bf16", 2, 4, dtype=torch.bfloat16)
    case = "bf16 engine vs fp32 trainer"
    assert [(r["case"], r["metric"]) for r in rows] == [
        (case, "mean |logp gap|"), (case, "max |logp gap|"), (case, "routing agreement")]
    for r in rows:
        assert set(r) == set(common.ROW_KEYS) and r["baseline_name"] == "no routing replay", r
        assert math.isfinite(r["ours"]) and math.isfinite(r["baseline"]), r
    agreement = rows[2]
    assert agreement["ours"] == 1.0  # measured: replay makes the trainer use the engine's experts
    assert 0.0 <= agreement["baseline"] <= 1.0
