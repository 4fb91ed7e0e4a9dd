"""data/vision.py: mrope_positions == transformers' get_rope_index (Qwen2.5-VL and Qwen3-VL,
random grids per run), the image-token bookkeeping, RowImages indexing, and the sampled
vision-token masks."""

import random

import pytest
import torch
import transformers

from hybridrl.data.vision import (ImageInputs, ImageTokenMismatch, RowImages, VisionTokens, mrope_positions,
                                  positions_of, split_runs)
from hybridrl.data.vision_mask import sampled_vision_tokens, vision_token_response_mask
from tests._seeds import fresh_seed

IMG, VID, VS, VE = 150, 151, 152, 153


def _model(kind: str):
    ids = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    text = dict(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1)
    if kind == "qwen2_5_vl":
        text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32), **ids)
        return transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    cfg = transformers.Qwen3VLConfig(text_config={**text, "head_dim": 16}, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
        deepstack_visual_indexes=[0], num_position_embeddings=64), **ids)
    return transformers.Qwen3VLForConditionalGeneration(cfg).eval()


def _sequence(rng: random.Random, merge: int = 2):
    """Random text around 0-3 images of random even grids; ``(ids, images | None)``."""
    grids = [(1, merge * rng.randint(1, 4), merge * rng.randint(1, 4)) for _ in range(rng.randint(0, 3))]
    ids = [rng.randint(0, 100) for _ in range(rng.randint(0, 5))]
    for t, h, w in grids:
        ids += [VS] + [IMG] * (t * h * w // merge**2) + [VE] + [rng.randint(0, 100) for _ in range(rng.randint(0, 4))]
    ids = ids or [5]
    if not grids:
        return ids, None
    grid = torch.tensor(grids)
    return ids, ImageInputs.of(torch.randn(int(grid.prod(-1).sum()), 12), grid)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_positions_equal_transformers_get_rope_index(kind):
    seed = fresh_seed()
    rng = random.Random(seed)
    model = _model(kind)
    tokens = VisionTokens.from_hf_config(model.config)
    for trial in range(25):
        ids, images = _sequence(rng)
        ours, delta = mrope_positions(ids, images, tokens)
        assert ours.shape == (3, len(ids))
        if images is None:
            assert torch.equal(ours, torch.arange(len(ids)).expand(3, -1)) and delta == 0
            continue
        t = torch.tensor([ids])
        hf, d = model.model.get_rope_index(t, mm_token_type_ids=(t == IMG).int(), image_grid_thw=images.grid_thw)
        assert torch.equal(hf[:, 0], ours), f"seed {seed} trial {trial}: {ids} {images.grid_thw.tolist()}"
        assert int(d) == delta, f"seed {seed} trial {trial}"
        # decode continues at i + delta, as transformers' cached rope_deltas do
        tail = positions_of(ours, delta, len(ids) - 1, len(ids) + 3)
        assert torch.equal(tail[:, 1:], torch.arange(len(ids), len(ids) + 3).expand(3, -1) + delta)


def test_image_tokens_must_match_image_features():
    tokens = VisionTokens(IMG, VID, VS, VE, 2)
    images = ImageInputs.of(torch.randn(4 * 4 + 2 * 4, 6), torch.tensor([[1, 4, 4], [1, 2, 4]]))  # 4 + 2 features
    ids = [1, VS] + [IMG] * 4 + [VE, 2, VS] + [IMG] * 2 + [VE]
    assert split_runs(ids, images, tokens) == [(2, 6), (9, 11)]
    adjacent = [1, VS] + [IMG] * 6 + [VE, 2]  # two images with nothing between them: one run, split by counts
    assert split_runs(adjacent, images, tokens) == [(2, 6), (6, 8)]
    # a sampled <|image_pad|> / <|video_pad|> (never enclosed by vision start / end) is text
    assert split_runs(ids + [IMG, 7, IMG, VID], images, tokens) == [(2, 6), (9, 11)]
    for bad in (ids[:-2] + [VE], ids[:3] + ids[4:], ids[:-1] + [IMG, VE], [1, 2]):  # truncated, an extra one, none
        with pytest.raises(ImageTokenMismatch, match="do not match"):
            split_runs(bad, images, tokens)
    with pytest.raises(ImageTokenMismatch, match="video"):
        split_runs(ids + [VS, VID, VE], images, tokens)


def test_row_images_index_like_batch_tensors():
    a = ImageInputs.of(torch.randn(4, 6), torch.tensor([[1, 2, 2]]))
    rows = RowImages([a, None, a, None])
    assert [r is a for r in rows[torch.tensor([2, 1])]] == [True, False]
    assert [r is a for r in rows[torch.tensor([True, False, False, True])]] == [True, False]
    assert len(rows[1:]) == 3 and rows[[0]].any and not rows[[1, 3]].any
    assert rows.concat().n_images == 2 and rows[[1]].concat() is None


def test_sampled_vision_token_masks():
    tokens = VisionTokens(IMG, VID, VS, VE, 2)
    ids = torch.tensor([[1, VS, IMG, VE, 5, 6, 0], [1, VS, IMG, VE, 5, IMG, 0], [1, 2, 3, VE, 9, 0, 0]])
    prompt_len = torch.tensor([4, 4, 3])
    hits = sampled_vision_tokens(ids, prompt_len, tokens)
    assert hits.sum(1).tolist() == [0, 1, 1]  # the prompt's own image tokens never count
    assert vision_token_response_mask(ids, prompt_len, tokens).tolist() == [True, False, False]
