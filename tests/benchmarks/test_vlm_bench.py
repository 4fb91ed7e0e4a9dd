"""Smoke test of benchmarks/vlm.py on a tiny Qwen2.5-VL / Qwen3-VL: every row is well-formed,
both generate sides produce the full length, and prefix reuse encodes no patch while the
re-prefill encodes every one of the conversation's pictures."""

from __future__ import annotations

import math

import pytest

from _bench_module import load_bench

TINY = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_vlm_bench_rows(arch):
    vlm, common = load_bench("vlm"), load_bench("_common")
    vl = vlm.make_vl(arch, **TINY)
    rows = vlm.bench_generate(vl, (1, 2), 2, 1) + vlm.bench_trainer(vl, 2, 2, 1) + vlm.bench_prefix(vl, 2, 1)
    assert [r["metric"] for r in rows] == ["tokens/s", "tokens/s", "step s", "TTFT ms", "patches encoded"]
    for r in rows:
        assert set(r) == set(common.ROW_KEYS), r
        assert math.isfinite(r["ours"]) and math.isfinite(r["baseline"]) and r["baseline"] > 0, r
    assert rows[0]["case"].startswith(f"{arch} b=1 T=2") and "transformers" in rows[0]["baseline_name"]
    assert rows[2]["baseline_name"] == "same batch, text-only rows (no vision tower)"
    (_, images), = vlm.vl_prompts(vl, 1, seed=3, n_images=2)
    patches = rows[4]
    assert patches["ours"] == 0 and patches["baseline"] == images.pixel_values.shape[0], patches
