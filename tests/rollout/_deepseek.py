"""Tiny random DeepSeek-V3 models (transformers' ``DeepseekV3ForCausalLM``), drawn per test.

``draw_config(rng)`` draws the architecture's knobs (q-LoRA or a plain q_proj, YaRN or
default RoPE, interleaved or not, groups, leading dense layers, shared experts, tied head)
from a seeded ``random.Random``; tests take the seed from ``fresh_seed()`` and print it in
their failure message, so every run draws new configs and a failure can be replayed.
"""
from __future__ import annotations

import random

import _seeds
import torch
import transformers

from hybridrl.refit.transport import named_trainer_tensors
from hybridrl.rollout import EngineSpec, RolloutEngine
from tests.rollout.conftest import make_hf_model

VOCAB = 101


def fresh_seed() -> int:
    """A new seed per call, derived from the test's seed (``tests/_seeds.py``: printed on failure,
    replayed by ``pytest --seed N``)."""
    return _seeds.fresh_seed()


def config(**overrides) -> transformers.DeepseekV3Config:
    """A fixed small config (every feature on); ``overrides`` replace fields."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
                  kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                  rope_interleave=True, routed_scaling_factor=2.5, norm_topk_prob=True,
                  max_position_embeddings=256, num_mtp_layers=0,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64, "mscale": 0.707,
                                   "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})
    fields.update(overrides)
    return transformers.DeepseekV3Config(**fields)


def draw_config(rng: random.Random, **overrides) -> transformers.DeepseekV3Config:
    heads = rng.choice([2, 4])
    n_group = rng.choice([1, 2, 4])
    experts = n_group * rng.choice([2, 3, 4])
    topk_group = rng.randint(1, n_group)
    top_k = rng.randint(1, min(4, topk_group * (experts // n_group)))
    layers = rng.randint(2, 3)
    yarn = rng.random() < 0.5
    rope = ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": rng.choice([2.0, 4.0, 40.0]),
             "original_max_position_embeddings": 32, "mscale": rng.choice([0.707, 1.0]),
             "mscale_all_dim": rng.choice([0.0, 0.707, 1.0]), "beta_fast": 32, "beta_slow": 1}
            if yarn else {"rope_type": "default", "rope_theta": rng.choice([10000.0, 50000.0])})
    fields = dict(num_attention_heads=heads, num_key_value_heads=heads, n_group=n_group, n_routed_experts=experts,
                  topk_group=topk_group, num_experts_per_tok=top_k, num_hidden_layers=layers,
                  first_k_dense_replace=rng.randint(0, layers - 1), n_shared_experts=rng.choice([1, 2]),
                  q_lora_rank=rng.choice([None, 16, 24]), kv_lora_rank=rng.choice([16, 32]),
                  qk_rope_head_dim=rng.choice([4, 8]), qk_nope_head_dim=rng.choice([8, 16]),
                  v_head_dim=rng.choice([8, 12, 16]), rope_interleave=rng.random() < 0.7,
                  norm_topk_prob=rng.random() < 0.7, routed_scaling_factor=rng.choice([1.0, 2.5]),
                  tie_word_embeddings=rng.random() < 0.25, rope_parameters=rope)
    fields.update(overrides)
    return config(**fields)


def hf_model(cfg, seed: int = 0, dtype=torch.float32):
    """Weights large enough that routing and greedy decoding are far from degenerate, and a
    random ``e_score_correction_bias`` (so selection and combine weights differ)."""
    model = make_hf_model(cfg, seed, experts_implementation="eager")
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    return model.to(dtype).eval()


def engine(cfg, hf=None, *, max_batch_size=8, max_seq_len=96, dtype=torch.float32, quantization=None, **kw):
    spec = EngineSpec(max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype, quantization=quantization)
    eng = RolloutEngine(cfg, spec, **kw)
    if hf is not None:
        eng.load_weights(named_trainer_tensors(hf))
    return eng
