"""LoRA adapter mode on the vLLM backend: vLLM applies the policy's adapter (``enable_lora``,
a new ``LoRARequest`` id per refit); a refit sends A/B only and is verified against vLLM's
LoRA slots. Compared with the trainer's peft model (fp32, 1e-5), with the base (B = 0 and
no adapter), and with a refit whose adapter never reached vLLM."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from _vllm_helpers import MAX_BATCH, MAX_SEQ, SKIP_NO_VLLM, assert_greedy_matches, encode

from hybridrl.refit import refit_from_model
from hybridrl.rollout import EngineSpec, SamplingParams
from hybridrl.rollout.layers.lora_adapter import AdapterSpec
from hybridrl.rollout.weight_update import WeightUpdateError
from hybridrl.trainer.logprobs import logprobs_in_microbatches

pytestmark = SKIP_NO_VLLM
# q and v of qkv_proj but not k: vLLM packs a partly adapted fused layer (k's slot stays zero)
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 4


@pytest.fixture(scope="module")
def lora_engine(tiny_checkpoint):
    """(VllmEngine in adapter mode, LoRAPolicy): the tiny checkpoint's model with rank-4
    adapters, B drawn (so the adapter changes the outputs), fully loaded once (version 1)."""
    from hybridrl.lora import apply_lora
    from hybridrl.vllm_backend import VllmEngine

    _, _, model = tiny_checkpoint
    lora = apply_lora(copy.deepcopy(model), rank=RANK, alpha=8.0, dropout=0.0, target_modules=TARGETS,
                      init="gaussian")
    _draw_b(lora, seed=11)
    spec = EngineSpec(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ,
                      lora=AdapterSpec(lora.rank, lora.scale, tuple(lora.targets)))
    engine = VllmEngine(lora.model.config, spec)
    refit_from_model(engine, lora.refit_tensors("adapter", full=True), verify=True)
    yield engine, lora
    engine.close()


def _draw_b(lora, seed: int, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora.layers.values():
            w = layer.lora_B["default"].weight
            w.copy_(torch.randn(w.shape, generator=g) * scale)


def _adapter_refit(engine, lora):
    return refit_from_model(engine, lora.refit_tensors("adapter", full=False, dtype=engine.dtype), verify=True,
                            partial=True)


def test_adapter_refits_match_the_peft_model(lora_engine, tiny_checkpoint):
    """Two adapter-only refits (new values each time): A/B only, a new adapter id, sampled
    log-probs == the trainer's peft model within 1e-5 (fp32)."""
    engine, lora = lora_engine
    _, tok, _ = tiny_checkpoint
    seed = random.randrange(1 << 16)
    for k in range(2):
        _draw_b(lora, seed=seed + k)
        with torch.no_grad():
            for layer in lora.layers.values():
                layer.lora_A["default"].weight.mul_(1.1)
        v0, id0 = engine.weight_version, engine.lora_request.lora_int_id
        stats = _adapter_refit(engine, lora)
        assert stats.num_tensors == 2 * len(lora.targets)
        assert engine.weight_version == v0 + 1
        assert engine.lora_request.lora_int_id == id0 + 1
        assert engine.llm.llm_engine.list_loras() == {id0 + 1}  # the previous adapter is gone
        ro = engine.generate(encode(tok), SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=seed))
        trainer, _ = logprobs_in_microbatches(lora.model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                              temperature=1.0, max_tokens=4096)
        gap = float(((trainer - ro.logprobs).abs() * ro.response_mask).max())
        assert gap <= 1e-5, f"refit {k}: max |vLLM - peft| log-prob {gap:.2e} (seed {seed})"
        greedy = engine.generate(encode(tok)[:3], SamplingParams(temperature=0.0, max_tokens=8))
        for p, toks in zip(encode(tok)[:3], greedy.response_token_ids):
            assert_greedy_matches(lora.model, p, toks)


def test_a_base_only_refit_keeps_the_adapter(lora_engine, tiny_checkpoint):
    """vLLM's reload drops every adapter; a refit of (changed) base weights alone registers the
    current one again: the log-probs are the peft model's with the new base, the adapter id unchanged."""
    engine, lora = lora_engine
    _, tok, _ = tiny_checkpoint
    _draw_b(lora, seed=random.randrange(1 << 16))
    _adapter_refit(engine, lora)
    lora_id = engine.lora_request.lora_int_id
    g = torch.Generator().manual_seed(random.randrange(1 << 16))
    with torch.no_grad():  # a base that changed: a refit that writes nothing would keep the old one
        for name, p in lora.model.named_parameters():
            if not p.requires_grad and p.is_floating_point():
                p.mul_(1 + 0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    refit_from_model(engine, lora.base_tensors(), verify=True, partial=True)
    assert engine.lora_request.lora_int_id == lora_id and engine.llm.llm_engine.list_loras() == {lora_id}
    ro = engine.generate(encode(tok), SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=5))
    trainer, _ = logprobs_in_microbatches(lora.model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                          temperature=1.0, max_tokens=4096)
    assert float(((trainer - ro.logprobs).abs() * ro.response_mask).max()) <= 1e-5


def test_zero_b_serves_exactly_the_base(lora_engine, tiny_checkpoint, monkeypatch):
    """B = 0: vLLM's sampled tokens and log-probs with the adapter equal its base model's
    (the same vLLM engine without a LoRARequest), and greedy equals transformers' base."""
    engine, lora = lora_engine
    _, tok, base = tiny_checkpoint
    with torch.no_grad():
        for layer in lora.layers.values():
            layer.lora_B["default"].weight.zero_()
    _adapter_refit(engine, lora)
    seed = random.randrange(1 << 16)
    params = SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=seed)
    with_adapter = engine.generate(encode(tok), params)
    monkeypatch.setattr(engine.adapter, "request", None)  # the same engine, no adapter
    without = engine.generate(encode(tok), params)
    monkeypatch.undo()
    assert torch.equal(with_adapter.input_ids, without.input_ids)
    assert torch.equal(with_adapter.logprobs, without.logprobs)
    greedy = engine.generate(encode(tok)[:3], SamplingParams(temperature=0.0, max_tokens=8))
    for p, toks in zip(encode(tok)[:3], greedy.response_token_ids):
        assert_greedy_matches(base, p, toks)


def test_a_refit_that_left_the_old_adapter_fails_loudly(lora_engine, tiny_checkpoint, monkeypatch):
    """vLLM's add_lora 'succeeds' but its slot keeps the previous adapter: the post-load
    check names the adapter tensors, the version stays, generate refuses; a good refit
    after it recovers."""
    from hybridrl.vllm_backend.lora import VllmAdapterSlot

    engine, lora = lora_engine
    _, tok, _ = tiny_checkpoint
    _draw_b(lora, seed=random.randrange(1 << 16))
    v0 = engine.weight_version
    keep_old = lambda slot, tensors: None  # noqa: E731 - nothing reaches vLLM
    monkeypatch.setattr(VllmAdapterSlot, "load", keep_old)
    with pytest.raises(WeightUpdateError, match=r"lora_B\.weight"):
        _adapter_refit(engine, lora)
    assert engine.weight_version == v0
    with pytest.raises(WeightUpdateError, match="failed"):
        engine.generate(encode(tok)[:1], SamplingParams(max_tokens=2))
    monkeypatch.undo()
    _adapter_refit(engine, lora)
    assert engine.weight_version == v0 + 1
    engine.generate(encode(tok)[:1], SamplingParams(max_tokens=2))


def test_a_module_vllm_cannot_adapt_is_one_line(tiny_checkpoint):
    from hybridrl.vllm_backend import VllmEngine

    _, _, model = tiny_checkpoint
    spec = EngineSpec(max_batch_size=4, max_seq_len=16, lora=AdapterSpec(4, 2.0, ("model.layers.0.input_layernorm",)))
    with pytest.raises(ValueError, match=r"vLLM does not apply LoRA to model.layers.0.input_layernorm.*lora_mode=merged") as e:
        VllmEngine(model.config, spec)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="rank 512"):
        VllmEngine(model.config, EngineSpec(max_batch_size=4, max_seq_len=16, lora=AdapterSpec(600, 1.0, ())))
