"""LoRA refit rows of ``benchmarks/refit.py`` (issue #27): adapter and merged refits against
the full refit a full-fine-tuning run does, on the built-in engine and on vLLM.

A Qwen2.5-0.5B-Instruct-shaped model (random init, bf16: vocabulary 151936, hidden 896,
24 layers, 14 / 2 heads, MLP 4864, tied head) with rank-16 adapters on q/k/v/o/gate/up/down
(B drawn: a trained adapter's values).

- Built-in engine: the adapter-mode refit (A/B only, verify off as in training), the
  merged-mode refit (``W + scale·B·A`` of the targeted weights, the product counted too);
  baseline: the full refit (every weight, same engine dtype, same bucket).
- vLLM (skipped when vLLM is missing): the adapter-mode refit (A/B only: a peft folder in
  /dev/shm, ``add_lora`` under a new id, the previous one removed, then its slot check)
  against the full refit of the same ``VllmEngine`` (every base weight through vLLM's
  ``reload_weights`` and its post-reload check), as a full-fine-tuning run on vLLM does.

Goals: adapter payload <= 2% and time <= 0.1x of the full refit.
"""
from __future__ import annotations

import torch

from _common import best_interleaved, row

from hybridrl.lora import apply_lora
from hybridrl.refit import refit_from_model
from hybridrl.rollout import EngineSpec, RolloutEngine
from hybridrl.rollout.layers.lora_adapter import AdapterSpec

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BUCKET = 256 << 20  # refit.bucket_mb's default
CASE = "qwen2.5-0.5b bf16 r16 qkvo+mlp"


def _mib(named) -> float:
    return sum(t.numel() * t.element_size() for _, t in named) / 2**20


def _policy():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B, max_position_embeddings=64)).to(torch.bfloat16).eval()
    lora = apply_lora(hf, rank=16, alpha=32, dropout=0.0, target_modules=TARGETS)
    with torch.no_grad():  # a trained adapter's values (B = 0 at init)
        for layer in lora.layers.values():
            layer.lora_B["default"].weight.normal_(0, 0.02)
    return lora


def lora_refit_rows(repeats: int, *, vllm: bool) -> list[dict]:
    lora = _policy()
    rows = builtin_rows(lora, repeats)
    if vllm:
        rows += vllm_rows(lora, repeats)
    return rows


def builtin_rows(lora, repeats: int) -> list[dict]:
    config = lora.model.config
    spec = EngineSpec(max_batch_size=1, max_seq_len=16, dtype=torch.bfloat16)
    adapter_spec = EngineSpec(max_batch_size=1, max_seq_len=16, dtype=torch.bfloat16,
                              lora=AdapterSpec(lora.rank, lora.scale, tuple(lora.targets)))
    full_engine, merged_engine, adapter_engine = (RolloutEngine(config, s) for s in (spec, spec, adapter_spec))
    full = lora.refit_tensors("merged", full=True)  # what a full-fine-tuning run sends: every weight
    adapter = lora.refit_tensors("adapter", full=False, dtype=torch.bfloat16)  # as RolloutWorker sends it
    merged = lora.refit_tensors("merged", full=False)
    refit_from_model(full_engine, full, bucket_bytes=BUCKET)
    refit_from_model(merged_engine, full, bucket_bytes=BUCKET)
    refit_from_model(adapter_engine, lora.refit_tensors("adapter", full=True), bucket_bytes=BUCKET)

    def partial(engine, named):
        return lambda: refit_from_model(engine, named, bucket_bytes=BUCKET, partial=True)

    t_full, t_adapter, t_merged = best_interleaved(
        [lambda: refit_from_model(full_engine, full, bucket_bytes=BUCKET), partial(adapter_engine, adapter),
         partial(merged_engine, merged)], repeats)
    # merged: the product W + scale·B·A is computed in the trainer each refit; count it too
    t_merge = best_interleaved([lora.merged_tensors], repeats)[0]
    base = f"full refit, every weight ({_mib(full):.0f} MiB bf16)"
    return [
        row(case=f"{CASE} adapter", metric="refit payload MiB", ours=_mib(adapter), baseline=_mib(full),
            baseline_name=base, higher_is_better=False),
        row(case=f"{CASE} adapter", metric="refit s", ours=t_adapter, baseline=t_full, baseline_name=base,
            higher_is_better=False),
        row(case=f"{CASE} merged", metric="refit payload MiB", ours=_mib(merged), baseline=_mib(full),
            baseline_name=base, higher_is_better=False),
        row(case=f"{CASE} merged", metric="refit s (+ merge in trainer)", ours=t_merged + t_merge, baseline=t_full,
            baseline_name=base, higher_is_better=False),
    ]


def vllm_rows(lora, repeats: int) -> list[dict]:
    """One ``VllmEngine`` in adapter mode: its adapter-only refit vs a refit of every base weight."""
    from hybridrl.vllm_backend import VllmEngine

    spec = EngineSpec(max_batch_size=1, max_seq_len=16, dtype=torch.bfloat16,
                      lora=AdapterSpec(lora.rank, lora.scale, tuple(lora.targets)))
    engine = VllmEngine(lora.model.config, spec)
    try:
        refit_from_model(engine, lora.refit_tensors("adapter", full=True), bucket_bytes=BUCKET)
        base = lora.base_tensors()  # every weight of a full-fine-tuning refit
        adapter = lora.refit_tensors("adapter", full=False, dtype=torch.bfloat16)
        t_full, t_adapter = best_interleaved(
            [lambda: refit_from_model(engine, base, bucket_bytes=BUCKET, partial=True),
             lambda: refit_from_model(engine, adapter, bucket_bytes=BUCKET, partial=True)], repeats)
    finally:
        engine.close()
    name = f"vLLM full refit: reload_weights of every weight + its check ({_mib(base):.0f} MiB bf16)"
    return [
        row(case=f"{CASE} vllm adapter", metric="refit payload MiB", ours=_mib(adapter), baseline=_mib(base),
            baseline_name=name, higher_is_better=False),
        row(case=f"{CASE} vllm adapter", metric="refit s", ours=t_adapter, baseline=t_full, baseline_name=name,
            higher_is_better=False),
    ]
