"""The built-in engine's MoE layers under exact numerics (``EngineSpec.exact``): its log-probs
are bitwise the trainer's recomputation for Qwen2-MoE (shared expert and its sigmoid gate,
``norm_topk_prob`` both ways) and Qwen3-MoE, in float32 and bf16, through continuous
batching and chunked prefill; the routing record keeps working (replaying it in the trainer
gives the same bits again); DeepSeek-V3's MoE block (sigmoid group-limited router, float32
combine weights, shared experts) equals transformers' ``DeepseekV3MoE`` bitwise whatever
the rows it is given with. Configs are drawn fresh per run (``_seeds.fresh_seed``) over the
fields that change the computation: widths, experts, top-k, heads / kv heads, head_dim, the
sparse-layer pattern (``decoder_sparse_step``, ``mlp_only_layers``), tying, rope base.
"""

from __future__ import annotations

import random

import _seeds
import pytest
import torch
from transformers import DeepseekV3Config, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from _engine_round_trip import (assert_bitwise, build_drawn, chunked_round_trip, draw_requests, exact_engine,
                                round_trip, trainer_logprobs)
from hybridrl.exact import batch_invariant
from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.model_config import parse_hf_config
from hybridrl.rollout.models.decoder.model import MLP
from hybridrl.rollout.models.moe.block import SparseMoeBlock
from hybridrl.rollout.routing import enable_routing_record

FAMILIES = {"qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}


def draw_moe(seed: int, dtype: torch.dtype, family: str | None = None, norm_topk_prob: bool | None = None):
    """A random-init 2-layer Qwen MoE decoder drawn from ``seed`` (``family`` / ``norm_topk_prob``
    pin those; at least one layer sparse); (model, description)."""
    rng = random.Random(seed)
    family = family or rng.choice(sorted(FAMILIES))
    heads = rng.choice([2, 4])
    experts = rng.randint(3, 8)
    fields = dict(vocab_size=rng.randint(96, 160), num_hidden_layers=2, num_attention_heads=heads,
                  num_key_value_heads=rng.choice([h for h in (1, 2, 4) if heads % h == 0]),
                  num_experts=experts, num_experts_per_tok=rng.randint(1, min(4, experts)),
                  moe_intermediate_size=rng.choice([16, 24, 40]), intermediate_size=rng.choice([48, 96]),
                  norm_topk_prob=rng.random() < 0.5 if norm_topk_prob is None else norm_topk_prob,
                  decoder_sparse_step=rng.choice([1, 1, 2]), mlp_only_layers=rng.choice([[], [], [0], [1]]),
                  tie_word_embeddings=rng.random() < 0.5, rms_norm_eps=rng.choice([1e-6, 1e-5]),
                  max_position_embeddings=256, rope_theta=rng.choice([1e4, 1e6]))
    step, dense = fields["decoder_sparse_step"], fields["mlp_only_layers"]
    if not [i for i in range(2) if i not in dense and (i + 1) % step == 0]:  # step 2 with layer 1 dense: no MoE layer left to test
        fields["mlp_only_layers"] = []
    head_dim = rng.choice([8, 16])
    if family == "qwen3_moe":
        fields.update(head_dim=head_dim, hidden_size=rng.choice([32, 48, 64]))
    else:
        fields.update(hidden_size=heads * head_dim, shared_expert_intermediate_size=rng.choice([16, 32, 56]),
                      qkv_bias=rng.random() < 0.7)
    return build_drawn(FAMILIES[family], family, fields, seed, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_families_are_bitwise_on_policy(dtype):
    """48 requests through 16 rows: rows join and finish at every step (continuous batching)."""
    seed = _seeds.fresh_seed()
    model, what = draw_moe(seed, dtype)
    round_trip(model, seed, n=48, temperature=0.7, top_p=0.9, what=what, max_batch_size=16)


@pytest.mark.parametrize("family,norm,dtype", [("qwen2_moe", True, torch.float32), ("qwen2_moe", False, torch.bfloat16),
                                               ("qwen3_moe", None, torch.float32)])
def test_chunked_prefill_and_renormalization_both_ways(family, norm, dtype):
    """Prompts up to 7x the prefill budget, prefilled in chunks between other rows' decode
    steps; 24 requests through 8 rows."""
    seed = _seeds.fresh_seed()
    model, what = draw_moe(seed, dtype, family, norm)
    chunked_round_trip(model, seed, what)


def test_routing_record_is_the_trainers_routing():
    """The exact engine records its expert choices as the plain engine does; the trainer
    replaying them (``routed_experts``) computes the same bits as without: they are its own."""
    seed = _seeds.fresh_seed()
    model, what = draw_moe(seed, torch.bfloat16)
    engine = exact_engine(model, max_batch_size=8)
    recorder = enable_routing_record(engine)
    prompts, params = draw_requests(random.Random(seed), 20, model.config.vocab_size)
    ro = engine.generate(prompts, params)
    routed = recorder.take(ro)
    fed = ro.attention_mask.bool().clone()
    fed[torch.arange(fed.shape[0]), ro.attention_mask.sum(1) - 1] = False  # the last token is never fed
    assert (routed[fed] >= 0).all() and (routed[~fed] == -1).all(), what
    assert_bitwise(model, ro, 1.0, what)
    mask = ro.response_mask.bool()
    with torch.no_grad(), batch_invariant():
        from hybridrl.trainer.logprobs import logprobs_in_microbatches

        replayed, _ = logprobs_in_microbatches(model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                               temperature=1.0, max_tokens=700, routed_experts=routed)
    assert torch.equal(replayed[mask], ro.logprobs[mask]), f"{what}: replaying the record changed the bits"
    assert torch.equal(trainer_logprobs(model, ro, 1.0)[mask], replayed[mask])


def _draw_deepseek(rng: random.Random) -> DeepseekV3Config:
    """A DeepSeek-V3 config whose MoE knobs are drawn (the attention is never built here)."""
    n_group = rng.choice([1, 2, 4])
    experts = n_group * rng.choice([2, 3, 4])
    topk_group = rng.randint(1, n_group)
    fields = dict(vocab_size=101, hidden_size=rng.choice([32, 48, 64]), intermediate_size=96,
                  moe_intermediate_size=rng.choice([16, 24, 32]), num_hidden_layers=2, first_k_dense_replace=1,
                  num_attention_heads=2, num_key_value_heads=2, n_shared_experts=rng.choice([1, 2]),
                  n_routed_experts=experts, n_group=n_group, topk_group=topk_group,
                  num_experts_per_tok=rng.randint(1, min(4, topk_group * (experts // n_group))),
                  norm_topk_prob=rng.random() < 0.7, routed_scaling_factor=rng.choice([1.0, 2.5]),
                  kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                  max_position_embeddings=256)
    cfg = DeepseekV3Config(**fields)
    cfg._experts_implementation = "eager"  # what exact_attention_for switches a model's experts to
    return cfg


def _deepseek_pair(cfg: DeepseekV3Config, dtype: torch.dtype):
    """(transformers' ``DeepseekV3MoE`` with random weights and correction bias, the engine's
    exact ``SparseMoeBlock`` holding the same weights), both in ``dtype``."""
    ref = DeepseekV3MoE(cfg)
    with torch.no_grad():
        for p in ref.parameters():  # the experts are torch.empty, the router zeros
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        ref.gate.e_score_correction_bias.copy_(0.2 * torch.randn_like(ref.gate.e_score_correction_bias))
    ref = ref.to(dtype)
    ref.gate.e_score_correction_bias.data = ref.gate.e_score_correction_bias.float()  # kept fp32, as loaded
    mcfg = parse_hf_config(cfg)
    ctx = LayerContext.for_quantization(None, dtype=dtype, device=torch.device("cpu"), exact=True).child("mlp")
    shared = MLP(mcfg, ctx.child("shared_experts"), mcfg.shared_expert_intermediate_size, reduce=False)
    ours = SparseMoeBlock(mcfg, 0, ctx, shared_expert=shared)
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        ours.gate.e_score_correction_bias.copy_(ref.gate.e_score_correction_bias)
        ours.experts.gate_up_proj.copy_(ref.experts.gate_up_proj)
        ours.experts.down_proj.copy_(ref.experts.down_proj)
        s = ref.shared_experts
        ours.shared_experts.gate_up_proj.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
        ours.shared_experts.down_proj.weight.copy_(s.down_proj.weight)
    return ref, ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v3_moe_block_is_transformers_bitwise(dtype):
    """200 random hidden states: transformers' block on all of them at once (the trainer's
    packed forward) == ours on them cut into groups of 1, 3, 17 and the rest (decode steps,
    a batch, a prefill chunk)."""
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    cfg = _draw_deepseek(rng)
    torch.manual_seed(seed)
    ref, ours = _deepseek_pair(cfg, dtype)
    x = torch.randn(200, cfg.hidden_size).to(dtype)
    with torch.no_grad(), batch_invariant():
        want = ref(x[None])[0]
    with torch.no_grad():
        got = torch.cat([ours(part[None])[0] for part in x.split([1, 3, 17, 179])])
    what = f"{dtype} seed={seed} {cfg.to_diff_dict()}"
    assert want.dtype == got.dtype == dtype, what
    differ = want != got
    assert not differ.any(), f"{what}: {int(differ.any(-1).sum())} of 200 tokens differ"
