"""vLLM on CUDA (GPU only; skipped without a CUDA device or without vLLM's CUDA build):

- FP8 rollout with CUDA graphs: after several verified refits (addresses of every parameter,
  buffer, KV cache and device tensor a layer / quantization method holds unchanged; exact FP8
  checksums) the graph engine replays what an eager engine loaded once with the final weights
  computes — graphs reading stale weights would replay the first ones.
- Colocation: sleep() returns the KV cache's memory to the device; the refit wakes weights
  (same addresses: verified), reloads, wakes the KV cache; rollouts equal the never-slept ones.
- Two GRPO steps on CUDA with FP8 rollout and free_cache_engine.

One live vLLM engine per process: engines are built one after the other. CUDA graphs without
torch.compile (``mode=0``, full decode graphs) keep each engine's start short.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from _vllm_helpers import SKIP_NO_VLLM, perturbed

from hybridrl.refit import refit_from_model
from hybridrl.rollout import SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              SKIP_NO_VLLM]
GRAPHS = {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                 "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}}
PROMPTS = [[3, 4, 5], [6, 7, 8, 9], [10, 2], [11, 12, 13, 14, 15]]


def _model(seed: int = 0) -> torch.nn.Module:
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=256, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _engine(cfg, quantization=None, **kwargs):
    from hybridrl.rollout import EngineSpec
    from hybridrl.vllm_backend import VllmEngine

    spec = EngineSpec(max_batch_size=16, max_seq_len=64, dtype=torch.bfloat16, device="cuda", quantization=quantization)
    return VllmEngine(cfg, spec, **kwargs)


def _rollouts(engine):
    sampled = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=7))
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    return sampled, greedy


def test_fp8_graph_replay_after_refits_equals_eager():
    base = _model()
    weights = [perturbed(base, seed=s, scale=0.1) for s in range(4)]
    graph = _engine(base.config, quantization="fp8", enforce_eager=False, **GRAPHS)
    try:
        from vllm.config import CUDAGraphMode

        mode = graph.llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
        assert mode != CUDAGraphMode.NONE, mode
        refit_from_model(graph, weights[0], verify=True)
        _, first = _rollouts(graph)  # decode graphs captured, replayed with weights[0]
        for w in weights[1:]:
            refit_from_model(graph, w, verify=True)
        sampled_g, greedy_g = _rollouts(graph)
    finally:
        graph.close()
    eager = _engine(base.config, quantization="fp8", enforce_eager=True)
    try:
        refit_from_model(eager, weights[-1], verify=True)
        sampled_e, greedy_e = _rollouts(eager)
    finally:
        eager.close()
    same = sum(a == b for a, b in zip(greedy_g.response_token_ids, greedy_e.response_token_ids))
    assert same >= len(PROMPTS) - 1, (greedy_g.response_token_ids, greedy_e.response_token_ids)
    assert first.response_token_ids != greedy_g.response_token_ids  # the refits changed what is replayed
    rows = [i for i, (a, b) in enumerate(zip(sampled_g.response_token_ids, sampled_e.response_token_ids)) if a == b]
    assert len(rows) >= len(PROMPTS)  # at least half of the sampled rows agree token for token
    mask = sampled_g.response_mask[rows].bool()
    assert (sampled_g.logprobs[rows] - sampled_e.logprobs[rows])[mask].abs().max() < 0.05  # bf16 GEMM tiling


def test_sleep_frees_the_kv_cache_and_the_refit_wakes_it_in_place():
    base = _model(1)
    weights = perturbed(base, seed=5, scale=0.1)
    kv_bytes = 1 << 30
    engine = _engine(base.config, free_cache_engine=True, enforce_eager=False, kv_cache_memory_bytes=kv_bytes,
                     **GRAPHS)
    try:
        refit_from_model(engine, weights, verify=True)
        sampled_a, greedy_a = _rollouts(engine)
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        torch.cuda.synchronize()
        assert torch.cuda.mem_get_info()[0] - free_awake >= 0.9 * kv_bytes  # the KV cache went back
        assert engine.llm.llm_engine.is_sleeping()
        refit_from_model(engine, weights, verify=True)  # wake weights (same addresses), reload, wake KV cache
        assert not engine.sleep_state.asleep and not engine.llm.llm_engine.is_sleeping()
        sampled_b, greedy_b = _rollouts(engine)
    finally:
        engine.close()
    assert greedy_a.response_token_ids == greedy_b.response_token_ids
    assert sampled_a.response_token_ids == sampled_b.response_token_ids
    assert (sampled_a.logprobs - sampled_b.logprobs).abs().max() < 1e-3


def test_two_grpo_steps_with_fp8_and_free_cache_engine_on_cuda(tmp_path):
    from hybridrl.config.io import load_config
    from hybridrl.job.loop import train

    cfg = load_config(None, [
        "rollout.backend=vllm", "rollout.quantization=fp8", "rollout.free_cache_engine=true",
        "rollout.enforce_eager=true", "model.dtype=bfloat16", "trainer.device=cuda", "model.hidden_size=128",
        "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.intermediate_size=256", "rollout.n=4",
        "rollout.max_tokens=4", "batch.prompts_per_step=4", "warm_start.steps=10", "warm_start.batch_size=8",
        "trainer.total_steps=2", "trainer.eval_every=2", "refit.verify=true", "data.train_size=200",
        "data.eval_size=8", "logging.tensorboard=false", "logging.plot=false", "logging.progress=false",
        "checkpoint.save=false", f"trainer.output_dir={tmp_path}"])
    steps = [r for r in train(cfg).history if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["refit/weight_version"] == r["rollout/weight_version"] + 1
        assert 0 < r["rollout/trainer_logprob_abs_diff"] < 0.05
