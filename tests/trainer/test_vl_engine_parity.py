"""The trainer scores what the engine sampled: on multimodal rollouts the built-in engine
sampled (temperature 1, a mixed batch of text-only rows, one image and several images of
different sizes, ``n = 2``, stopping at the vision tokens as the pipeline does), the
trainer's packed log-probs (varlen and bucketed) equal the engine's sampling log-probs
within 1e-5 in float32, for Qwen2.5-VL and Qwen3-VL policies drawn per run."""

from __future__ import annotations

import pytest
import torch

from hybridrl.data.vision import RowImages, VisionTokens
from hybridrl.refit.transport import named_trainer_tensors
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.trainer.forward import ForwardOptions, compute_logprobs_entropy
from tests._seeds import fresh_seed
from tests.trainer._vl import draw_model, draw_rows

TOL = 1e-5


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_trainer_logprobs_equal_the_engines_on_sampled_multimodal_rollouts(arch: str) -> None:
    seed = fresh_seed()
    model, tokenizer, _ = draw_model(arch, seed)
    rows, images = draw_rows(model, seed, n_rows=6)
    prompts = [ids[:prompt_len] for ids, prompt_len in rows]
    engine = RolloutEngine(model.config, EngineSpec(max_batch_size=16, max_seq_len=96, dtype=torch.float32))
    engine.load_weights(named_trainer_tensors(model))
    stops = (tokenizer.eos_token_id, *VisionTokens.from_hf_config(model.config).special_ids)
    params = SamplingParams(temperature=1.0, n=2, max_tokens=8, seed=seed % 2**31, stop_token_ids=stops)
    ro = engine.generate(prompts, params, images=list(images))
    assert ro.images is not None and len(ro.images) == 2 * len(prompts)
    mask = ro.response_mask.bool()
    for backend in ("varlen", "bucketed"):
        with torch.no_grad():
            lp, _ = compute_logprobs_entropy(model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                             images=ro.images, options=ForwardOptions(attn_backend=backend))
        gap = (lp[mask] - ro.logprobs[mask]).abs().max().item()
        assert gap <= TOL, f"seed {seed}, {arch}, {backend}: trainer vs engine log-prob gap {gap:.3g} > {TOL}"
    # the rows' images are each prompt's, repeated for its samples
    assert [r is None for r in ro.images.rows] == [images.rows[b // 2] is None for b in range(2 * len(prompts))]
    assert isinstance(ro.images, RowImages)
