"""DeepSeek-V3 multi-head latent attention in the built-in engine under exact numerics
(``EngineSpec.exact``): its log-probs are bitwise the trainer's recomputation
(transformers' ``DeepseekV3ForCausalLM`` under ``hybridrl.exact``).

Configs are drawn fresh per run over what changes MLA's computation: q-LoRA rank (None: a
plain ``q_proj``) or a number, ``kv_lora_rank``, the nope / rope / v head widths, heads,
interleaved or rotate-half rope, default rope or YaRN (its cos/sin ``attention_factor`` and
the softmax's mscale), attention biases, tied heads, eps. The engine keeps the latent cache
and rebuilds each row's keys and values from it every step (``models/deepseek_v3/mla_exact.py``).
"""

from __future__ import annotations

import random

import _seeds
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from _engine_round_trip import (assert_bitwise, chunked_round_trip, continuation_round_trip, draw_requests,
                                exact_engine, round_trip)
from hybridrl.exact.ops import exact_log_softmax
from hybridrl.job.model_factory import cast_as_loaded
from hybridrl.rollout import EngineSpec, RolloutEngine
from hybridrl.rollout.exact_support import exact_refusal
from hybridrl.rollout.model_config import parse_hf_config


def draw_mla(seed: int, dtype: torch.dtype, *, moe: bool = False, **overrides):
    """A random-init DeepSeek-V3 drawn from ``seed``: every layer dense unless ``moe`` (then
    DeepSeekMoE after a drawn number of dense layers); (model, description)."""
    rng = random.Random(seed)
    heads, layers = rng.choice([2, 4]), 2
    yarn = rng.random() < 0.5
    rope = ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": rng.choice([2.0, 4.0, 40.0]),
             "original_max_position_embeddings": 32, "mscale": rng.choice([0.707, 1.0]),
             "mscale_all_dim": rng.choice([0.0, 0.707, 1.0]), "beta_fast": 32, "beta_slow": 1}
            if yarn else {"rope_type": "default", "rope_theta": rng.choice([1e4, 5e4])})
    fields = dict(vocab_size=rng.randint(96, 160), hidden_size=rng.choice([32, 48, 64]), num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=rng.choice([48, 96]),
                  q_lora_rank=rng.choice([None, 16, 24]), kv_lora_rank=rng.choice([16, 32]),
                  qk_nope_head_dim=rng.choice([8, 16]), qk_rope_head_dim=rng.choice([4, 8]),
                  v_head_dim=rng.choice([8, 12, 16]), rope_interleave=rng.random() < 0.7,
                  attention_bias=rng.random() < 0.3, tie_word_embeddings=rng.random() < 0.3,
                  rms_norm_eps=rng.choice([1e-6, 1e-5]), max_position_embeddings=256, num_mtp_layers=0,
                  rope_parameters=rope, first_k_dense_replace=layers,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16,
                  n_shared_experts=1)
    if moe:
        fields.update(first_k_dense_replace=rng.randint(0, layers - 1), n_group=rng.choice([1, 2, 4]),
                      routed_scaling_factor=rng.choice([1.0, 2.5]), norm_topk_prob=rng.random() < 0.7)
        fields["topk_group"] = rng.randint(1, fields["n_group"])
        fields["num_experts_per_tok"] = rng.randint(1, min(4, fields["topk_group"] * 8 // fields["n_group"]))
    fields.update(overrides)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**fields))
    with torch.no_grad():  # weights large enough that the distributions are far from uniform
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    return cast_as_loaded(model, dtype).eval(), f"deepseek_v3 {dtype} seed={seed} {fields}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_is_bitwise_on_policy_with_continuous_batching(dtype):
    """64 requests through 24 rows: rows join and finish at every step."""
    seed = _seeds.fresh_seed()
    model, what = draw_mla(seed, dtype)
    spec = EngineSpec(max_batch_size=2, max_seq_len=16, exact=True)
    assert exact_refusal(parse_hf_config(model.config), spec) is None, what
    round_trip(model, seed, temperature=0.8, top_p=0.95, what=what)


def test_mla_with_chunked_prefill():
    """Chunks extend over the cached latent."""
    seed = _seeds.fresh_seed()
    model, what = draw_mla(seed, torch.float32)
    chunked_round_trip(model, seed, what)


def test_mla_bf16_yarn_with_q_lora_and_chunked_prefill():
    """The DeepSeek-V3 shape pinned (q-LoRA, interleaved YaRN rope with both mscales) in bf16,
    widths drawn; chunked prefill and continuous batching together."""
    seed = _seeds.fresh_seed()
    model, what = draw_mla(seed, torch.bfloat16, q_lora_rank=24, rope_interleave=True,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                            "original_max_position_embeddings": 32, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    prompts, params = draw_requests(random.Random(seed), 20, model.config.vocab_size, prompt_len=(4, 40),
                                    max_tokens=(3, 20))
    engine = exact_engine(model, max_batch_size=6, max_seq_len=72, max_prefill_tokens=12)
    assert_bitwise(model, engine.generate(prompts, params), 1.0, what)


def test_mla_continuation_from_the_retained_latent_is_bitwise():
    """Turn 2 extends turn 1's cached latent (no re-prefill)."""
    seed = _seeds.fresh_seed()
    model, what = draw_mla(seed, torch.float32)
    continuation_round_trip(model, seed, what, max_batch_size=4)


def test_mla_full_sequence_logits_match_the_rollout_bits():
    """``engine.logits`` (no cache: each row's latents expanded from its first token; rows
    left-padded here) gives the sampled tokens the rollout's log-probs."""
    seed = _seeds.fresh_seed()
    model, what = draw_mla(seed, torch.bfloat16)
    prompts, params = draw_requests(random.Random(seed), 12, model.config.vocab_size)
    engine = exact_engine(model)
    ro = engine.generate(prompts, params)
    shift = [int(s) for s in (~ro.attention_mask.bool()).sum(1)]  # right-aligned copies: left padding
    left = torch.stack([torch.roll(r, s) for r, s in zip(ro.input_ids, shift)])
    left_mask = torch.stack([torch.roll(r, s) for r, s in zip(ro.attention_mask, shift)])
    with torch._C.DisableTorchFunction():
        logp = exact_log_softmax(engine.logits(left, left_mask))
    got = logp[:, :-1].gather(-1, left[:, 1:, None]).squeeze(-1)
    resp = torch.stack([torch.roll(r, s) for r, s in zip(ro.response_mask, shift)])[:, 1:].bool()
    want = torch.stack([torch.roll(r, s) for r, s in zip(ro.logprobs, shift)])[:, 1:]
    assert torch.equal(got[resp], want[resp]), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_deepseek_v3_with_moe_layers(dtype):
    """MLA and DeepSeekMoE together (grouped sigmoid router, shared experts, leading dense
    layers drawn): bitwise where the MoE layers are exact (``models/moe/block.py``); until
    then the engine refuses the model in one line naming MoE, not the attention."""
    seed = _seeds.fresh_seed()
    model, what = draw_mla(seed, dtype, moe=True)
    why = exact_refusal(parse_hf_config(model.config), EngineSpec(max_batch_size=2, max_seq_len=16, exact=True))
    if why is not None:
        assert why.startswith("MoE") and "\n" not in why, why
        with pytest.raises(ValueError, match="exact numerics: MoE"):
            RolloutEngine(model.config, EngineSpec(max_batch_size=2, max_seq_len=16, exact=True))
        pytest.skip(f"DeepSeekMoE is refused under exact numerics: {why}")
    prompts, params = draw_requests(random.Random(seed), 32, model.config.vocab_size, prompt_len=(4, 40),
                                    max_tokens=(3, 20))
    engine = exact_engine(model, max_batch_size=10, max_seq_len=72, max_prefill_tokens=16)
    assert_bitwise(model, engine.generate(prompts, params), 1.0, what)
