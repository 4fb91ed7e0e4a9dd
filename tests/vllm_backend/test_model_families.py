"""Llama (untied) and Qwen3 (tied, q/k norms) through VllmEngine: a verified refit, then
sampled log-probs = the trainer's recompute and greedy = transformers (Qwen2 is covered
in test_vllm_engine.py); the same in LoRA adapter mode against the peft model."""

from __future__ import annotations

import pytest
import torch
import transformers
from _vllm_helpers import SKIP_NO_VLLM, assert_greedy_matches

from hybridrl.refit import refit_from_model
from hybridrl.rollout import SamplingParams

pytestmark = SKIP_NO_VLLM
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, False),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, True),
}


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora-adapter"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_refit_logprobs_and_greedy(family, lora):
    """``lora``: the engine in LoRA adapter mode (rank 4 on every projection): the full refit
    carries a B = 0 adapter (the checks below see the base), then an adapter-only refit with
    B drawn must match the peft model the same way."""
    from hybridrl.rollout import EngineSpec
    from hybridrl.trainer.forward import ForwardOptions, compute_logprobs_entropy
    from hybridrl.vllm_backend import VllmEngine

    config_cls, model_cls, tied = FAMILIES[family]
    cfg = config_cls(vocab_size=40, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    policy, spec = None, EngineSpec(max_batch_size=16, max_seq_len=32)
    if lora:
        import copy
        import dataclasses

        from hybridrl.config import LoRAConfig
        from hybridrl.lora import apply_lora
        from hybridrl.rollout.layers.lora_adapter import AdapterSpec

        policy = apply_lora(copy.deepcopy(model), rank=4, alpha=8.0, dropout=0.0,
                            target_modules=LoRAConfig().target_modules)
        spec = dataclasses.replace(spec, lora=AdapterSpec(4, 2.0, tuple(policy.targets)))
    engine = VllmEngine(cfg, spec)
    prompts = [[3, 4, 5], [6, 7, 8, 9], [10, 2]]

    def check(reference):
        ro = engine.generate(prompts, SamplingParams(temperature=0.9, max_tokens=8, n=3, seed=2))
        with torch.no_grad():
            lp, _ = compute_logprobs_entropy(reference, ro.input_ids, ro.attention_mask, ro.response_mask,
                                             options=ForwardOptions(temperature=0.9))
        mask = ro.response_mask.bool()
        assert (lp - ro.logprobs)[mask].abs().max() < 1e-4
        greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8)).response_token_ids
        for p, toks in zip(prompts, greedy):
            assert_greedy_matches(reference, p, toks)

    try:
        assert engine.weight_routes.tied == tied
        refit_from_model(engine, model if policy is None else policy.refit_tensors("adapter", full=True),
                         verify=True)
        assert engine.weight_version == 1
        check(model)
        if policy is not None:
            with torch.no_grad():
                for layer in policy.layers.values():
                    layer.lora_B["default"].weight.normal_(0, 0.3)
            refit_from_model(engine, policy.refit_tensors("adapter", full=False), verify=True, partial=True)
            check(policy.model)
    finally:
        engine.close()
