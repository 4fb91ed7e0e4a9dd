"""Smoke test of the continuous-batching rows (benchmarks/_continuous.py) and of
benchmarks/agents.py on tiny sizes: the rows are well-formed and the invariants each run
checks before timing hold (same samples both ways, the cached prefix really used). No
wall-clock thresholds."""

from __future__ import annotations

import math

import torch
import transformers

from _bench_module import load_bench

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, max_position_embeddings=2048)


def _model():
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)).eval()


def _well_formed(rows):
    common = load_bench("_common")
    for r in rows:
        assert set(r) == set(common.ROW_KEYS) and math.isfinite(r["ours"]) and math.isfinite(r["baseline"]), r


def test_long_tail_conversation_no_regression_and_kv_on_refit_rows():
    cont = load_bench("_continuous")
    hf = _model()
    lengths = cont.heavy_tailed_lengths(200, cap=64, scale=4)
    assert max(lengths) <= 64 and min(lengths) >= 4 and sorted(lengths)[100] < 16  # most short, a few long
    rows = cont.bench_long_tail(hf, count=12, rows=4, cap=32, scale=2, repeats=1)
    rows += cont.bench_conversation(hf, history=80, turn=8, reply=4, repeats=1)
    rows += cont.bench_kv_on_refit(hf, requests=3, tokens=12, refit_after=4, noise=1e-2, repeats=1)
    _well_formed(rows)
    assert [r["metric"] for r in rows] == ["tokens/s", "time to first token s", "turn with a 4-token reply s",
                                           "seconds refit -> done", "post-refit greedy tokens = exact (%)",
                                           "tokens until first divergence (mean)"]
    assert 0 <= rows[-2]["ours"] <= 100


def test_agents_episode_prefills_less_when_continued():
    agents = load_bench("agents")
    tok = agents.qwen_tokenizer(agents.CHATML)
    model = agents.episode_model(tok, hidden=32, layers=1)
    from hybridrl.rollout import EngineSpec, RolloutEngine

    engine = RolloutEngine(model.config, EngineSpec(max_batch_size=2, max_seq_len=1024))
    engine.load_weights(model.named_parameters())
    ep = agents.Episode(engine, tok, turns=3, turn_tokens=4, opening="Sum the items.")
    with torch.inference_mode():
        (ours, ours_len), (base, base_len) = ep.continued(), ep.re_rendered()
    assert ours < base and ours_len > 0 and base_len > 0
    assert not engine.scheduler.prefixes.entries and not engine.has_unfinished_requests()
