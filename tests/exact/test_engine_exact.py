"""The built-in engine under exact numerics (``EngineSpec.exact``): its log-probs are bitwise
the trainer's recomputation for the dense decoder families, whatever the engine did to the
request: continuous batching with other neighbours, chunked prefill, a continuation from a
retained prefix, mixed temperatures. Configs are drawn fresh per run over the fields that
change the computation (family: Qwen2 with q/k/v biases, Llama without, Qwen3 with q/k norms
and its own head_dim; widths, heads, kv heads, tying, rope base and llama3 scaling, eps).
"""

from __future__ import annotations

import random

import _seeds
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from _engine_round_trip import (assert_bitwise, build_drawn, chunked_round_trip, continuation_round_trip,
                                draw_requests, exact_engine, round_trip, trainer_logprobs)
from hybridrl.exact.ops import exact_log_softmax
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams

FAMILIES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def draw_dense(seed: int, dtype: torch.dtype, family: str | None = None):
    """A random-init dense decoder of a family drawn from ``seed`` (``family`` pins it); (model, description)."""
    rng = random.Random(seed)
    family = family or rng.choice(sorted(FAMILIES))
    heads = rng.choice([2, 4])
    kv = rng.choice([h for h in (1, 2, 4) if heads % h == 0])
    head_dim = rng.choice([8, 16])
    fields = dict(vocab_size=rng.randint(96, 160), hidden_size=rng.choice([32, 48, 64]), num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=rng.choice([48, 96, 128]),
                  tie_word_embeddings=rng.random() < 0.5, rms_norm_eps=rng.choice([1e-6, 1e-5]),
                  max_position_embeddings=256, rope_theta=rng.choice([1e4, 1e6]))
    if family in ("llama", "qwen3"):
        fields["head_dim"] = head_dim
    else:
        fields["hidden_size"] = heads * head_dim
    if family == "llama":
        fields["attention_bias"] = fields["mlp_bias"] = rng.random() < 0.3
        if rng.random() < 0.5:
            fields["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return build_drawn(FAMILIES[family], family, fields, seed, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_families_are_bitwise_on_policy(dtype):
    """64 requests through 24 rows: rows join and finish at every step (continuous batching)."""
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, dtype)
    round_trip(model, seed, temperature=0.7, top_p=0.9, what=what)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_with_chunked_prefill(family):
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, torch.float32, family)
    chunked_round_trip(model, seed, what)


def test_a_request_alone_equals_it_among_others():
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, torch.bfloat16)
    prompts, params = draw_requests(random.Random(seed), 40, model.config.vocab_size, temperature=0.8)
    engine = exact_engine(model, max_batch_size=16)
    batched = engine.generate(prompts, params)
    for i in (0, 17, 39):
        alone = engine.generate([prompts[i]], [params[i]])
        n = int(alone.response_mask.sum())
        row = batched.response_mask[i].bool()
        assert batched.input_ids[i][row].tolist() == alone.input_ids[0][alone.response_mask[0].bool()].tolist(), what
        assert torch.equal(batched.logprobs[i][row], alone.logprobs[0][alone.response_mask[0].bool()]), what
        assert n == int(row.sum())


def test_continuation_from_a_retained_prefix_is_bitwise():
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, torch.float32)
    continuation_round_trip(model, seed, what)


def test_mixed_temperatures_and_greedy_rows_in_one_batch():
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, torch.float32)
    rng = random.Random(seed)
    prompts, _ = draw_requests(rng, 30, model.config.vocab_size)
    temps = [(0.0, 0.6, 1.0)[i % 3] for i in range(30)]
    params = [SamplingParams(temperature=t, max_tokens=rng.randint(3, 16), seed=i) for i, t in enumerate(temps)]
    ro = exact_engine(model, max_batch_size=12).generate(prompts, params)
    for t in (0.0, 0.6, 1.0):
        rows = torch.tensor([i for i in range(30) if temps[i] == t])
        old = trainer_logprobs(model, ro, 1.0 if t == 0 else t)[rows]  # greedy rows are scored at 1
        mask = ro.response_mask[rows].bool()
        assert torch.equal(old[mask], ro.logprobs[rows][mask]), f"temperature {t}: {what}"


def test_full_sequence_logits_match_the_rollout_bits():
    """``engine.logits`` (the doctor's and eval's scoring path; rows left-padded here) gives the
    sampled tokens the rollout's log-probs."""
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, torch.float32)
    prompts, params = draw_requests(random.Random(seed), 12, model.config.vocab_size)
    engine = exact_engine(model)
    ro = engine.generate(prompts, params)
    ids, mask = ro.input_ids, ro.attention_mask
    shift = (~mask.bool()).sum(1)  # right-aligned copy: left padding
    left = torch.stack([torch.roll(r, int(s)) for r, s in zip(ids, shift)])
    left_mask = torch.stack([torch.roll(r, int(s)) for r, s in zip(mask, shift)])
    with torch._C.DisableTorchFunction():
        logp = exact_log_softmax(engine.logits(left, left_mask))
    got = logp[:, :-1].gather(-1, left[:, 1:, None]).squeeze(-1)
    resp = torch.stack([torch.roll(r, int(s)) for r, s in zip(ro.response_mask, shift)])[:, 1:].bool()
    want = torch.stack([torch.roll(r, int(s)) for r, s in zip(ro.logprobs, shift)])[:, 1:]
    assert torch.equal(got[resp], want[resp]), what


@pytest.mark.parametrize("spec,why", [(dict(quantization="fp8"), "quantized rollout weights")])
def test_what_cannot_hold_is_refused_in_one_line(spec, why):
    model, _ = draw_dense(1, torch.float32, "qwen2")
    with pytest.raises(ValueError, match=f"exact numerics: {why}") as e:
        RolloutEngine(model.config, EngineSpec(max_batch_size=2, max_seq_len=16, exact=True, **spec))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_adapters_are_bitwise(dtype):
    """The engine applies the adapters as peft's forward does (base + B(A(x)) * scale per
    HF module, each GEMM row-tiled), over a fused qkv / gate_up layer."""
    from hybridrl.lora import apply_lora
    from hybridrl.refit import refit_from_model
    from hybridrl.rollout.layers.lora_adapter import AdapterSpec

    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, dtype)
    rng = random.Random(seed)
    targets = rng.sample(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 3)
    lora = apply_lora(model, rank=rng.choice([2, 4]), alpha=8.0, dropout=0.0, target_modules=targets)
    with torch.no_grad():  # a trained adapter: B = 0 would leave the base model
        for n, p in lora.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.1)
    spec = AdapterSpec(lora.rank, lora.scale, tuple(lora.targets))
    engine = RolloutEngine(lora.model.config, EngineSpec(max_batch_size=24, max_seq_len=64, dtype=dtype, exact=True,
                                                         lora=spec))
    refit_from_model(engine, lora.refit_tensors("adapter", full=True), verify=True)
    prompts, params = draw_requests(rng, 48, model.config.vocab_size)
    assert_bitwise(lora.model, engine.generate(prompts, params), 1.0, f"{what} lora on {targets}")


def test_per_shard_gemms_where_the_fused_gemm_would_differ(monkeypatch):
    """On a machine whose BLAS gives a fused qkv / gate_up GEMM other column bits than the
    per-shard ones (``fused_is_exact`` False), the layers multiply shard by shard: still bitwise."""
    import hybridrl.rollout.layers.exact_linear as exact_linear

    monkeypatch.setattr(exact_linear, "fused_is_exact", lambda *shape: False)
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, torch.bfloat16)
    round_trip(model, seed, n=32, what=what)
