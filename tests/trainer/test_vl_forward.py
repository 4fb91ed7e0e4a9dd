"""The trainer's VL forward (trainer/vision_forward.py): packed log-probs (varlen, bucketed)
== transformers' own padded forward of Qwen2.5-VL / Qwen3-VL (left and right padding, text-only
rows, one image, several images of different sizes), values and gradients into the vision
tower; the image bookkeeping (truncation, packing, a sampled <|image_pad|>); freezing."""

import random

import pytest
import torch

from hybridrl.attention import varlen
from hybridrl.config import AlgoConfig, OptimConfig
from hybridrl.data.vision import ImageTokenMismatch, VisionTokens
from hybridrl.trainer.actor import Actor
from hybridrl.trainer.forward import ForwardOptions, compute_logprobs_entropy
from hybridrl.trainer.vision_model import freeze_vision_tower, vision_parameters
from tests._seeds import fresh_seed
from tests.trainer._vl import draw_model, draw_rows, hf_logprobs, pad_rows

ARCHS = ["qwen2_5_vl", "qwen3_vl"]


@pytest.fixture(autouse=True)
def _sdpa_fallback(monkeypatch):
    monkeypatch.setattr(varlen, "USE_FLASH_ATTN", False)


@pytest.mark.parametrize("backend", ["varlen", "bucketed"])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_equals_transformers_padded_forward_with_grads(arch, backend):
    seed = fresh_seed()
    rng = random.Random(seed)
    model, _, spec = draw_model(arch, seed)
    rows, images = draw_rows(model, seed + 1, n_rows=rng.randint(3, 6))
    temperature = rng.choice([1.0, 0.7])
    budget = rng.choice([None, 40, 80])  # packing: one call or several micro-batches
    params = [p for _, p in vision_parameters(model)] + [model.lm_head.weight]
    for side in ("right", "left"):
        ids, mask, response = pad_rows(rows, side)
        weights = torch.randn(ids.shape)
        ref = hf_logprobs(model, ids, mask, response, images, temperature)
        ref_grads = torch.autograd.grad((ref * weights).sum(), params)
        lp, _ = compute_logprobs_entropy(model, ids, mask, response, images=images, options=ForwardOptions(
            temperature=temperature, attn_backend=backend, max_tokens_per_microbatch=budget, vocab_chunk_tokens=7))
        where = f"seed {seed} {arch} {backend} {side} padding, {spec}"
        torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: {m}")
        grads = torch.autograd.grad((lp * weights).sum(), params)
        assert grads[0].abs().sum() > 0, f"{where}: no gradient reaches the vision tower"
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("arch", ARCHS)
def test_images_matter_and_text_rows_do_not_see_them(arch):
    seed = fresh_seed()
    model, _, _ = draw_model(arch, seed)
    rows, images = draw_rows(model, seed + 1, n_rows=3)
    ids, mask, response = pad_rows(rows, "right")
    with torch.no_grad():
        lp, _ = compute_logprobs_entropy(model, ids, mask, response, images=images)
        images.rows[1] = type(images.rows[1]).of(torch.randn_like(images.rows[1].pixel_values),
                                                 images.rows[1].grid_thw)
        other, _ = compute_logprobs_entropy(model, ids, mask, response, images=images)
    assert torch.equal(lp[0], other[0]) and torch.equal(lp[2], other[2]), f"seed {seed}"
    assert not torch.allclose(lp[1], other[1]), f"seed {seed}: row 1's new pixels changed nothing"


@pytest.mark.parametrize("arch", ARCHS)
def test_image_tokens_must_match_features_after_truncation(arch):
    seed = fresh_seed()
    model, _, _ = draw_model(arch, seed)
    rows, images = draw_rows(model, seed + 1, n_rows=3)
    tokens = VisionTokens.from_hf_config(model.config)
    ids, prompt_len = rows[2]
    first = ids.index(tokens.image_token_id)
    for cut in (ids[first + 1:], ids[:first] + ids[first + 1:]):  # left-truncated into an image; one token lost
        bad = [rows[0], rows[1], (cut, prompt_len - (len(ids) - len(cut)))]
        for side in ("left", "right"):
            with pytest.raises(ImageTokenMismatch, match="row 2: image tokens and image features do not match"):
                compute_logprobs_entropy(model, *pad_rows(bad, side), images=images)
    with pytest.raises(ImageTokenMismatch, match="row 0"):  # a text row given another row's images
        compute_logprobs_entropy(model, *pad_rows(rows, "right"), images=images[[1, 1, 2]])


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_vision_tokens_in_a_response_train_without_error(arch):
    seed = fresh_seed()
    model, _, _ = draw_model(arch, seed)
    rows, images = draw_rows(model, seed + 1, n_rows=4)
    tokens = VisionTokens.from_hf_config(model.config)
    sampled = [tokens.image_token_id, tokens.video_token_id, tokens.vision_end_id]
    rows = [(ids + [sampled[b % 3], 30, tokens.image_token_id, tokens.vision_start_id], p)
            for b, (ids, p) in enumerate(rows)]
    ids, mask, response = pad_rows(rows, "right")
    actor = Actor(model, optim=OptimConfig(lr=1e-3, warmup_steps=1), algo=AlgoConfig(), temperature=1.0)
    before = [p.detach().clone() for _, p in vision_parameters(model)]
    batch = dict(input_ids=ids, attention_mask=mask, response_mask=response,
                 advantages=torch.randn(len(rows), 1) * response, images=images)
    metrics = actor.update(batch, mini_batch_size=len(rows), epochs=1)
    assert metrics["actor/nonfinite_skipped"] == 0.0, f"seed {seed}"
    assert any(not torch.equal(b, p) for b, (_, p) in zip(before, vision_parameters(model))), f"seed {seed}"
    old = actor.compute_log_prob(ids, mask, response, images=images)[0]
    assert torch.isfinite(old).all() and (old[response.bool()] < 0).all(), f"seed {seed}"


@pytest.mark.parametrize("arch", ARCHS)
def test_frozen_vision_tower_gets_no_gradient_and_no_optimizer_state(arch):
    seed = fresh_seed()
    model, _, _ = draw_model(arch, seed)
    rows, images = draw_rows(model, seed + 1, n_rows=3)
    assert freeze_vision_tower(model) == len(vision_parameters(model))
    actor = Actor(model, optim=OptimConfig(), algo=AlgoConfig(), temperature=1.0)
    in_optimizer = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in in_optimizer for _, p in vision_parameters(model))
    ids, mask, response = pad_rows(rows, "left")
    lp, _ = compute_logprobs_entropy(model, ids, mask, response, images=images)
    lp.sum().backward()
    assert all(p.grad is None for _, p in vision_parameters(model)), f"seed {seed}"
    assert model.lm_head.weight.grad is not None
