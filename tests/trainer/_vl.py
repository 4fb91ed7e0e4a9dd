"""Tiny Qwen2.5-VL / Qwen3-VL policies drawn from a seed, and batches that mix text-only
rows, one image and several images of different sizes (the trainer's VL tests)."""

import random

import torch

from hybridrl.config import ModelConfig
from hybridrl.data.vision import ImageInputs, RowImages, VisionTokens
from hybridrl.job.model_factory import builtin_model, builtin_tokenizer


def draw_model(arch: str, seed: int):
    """A built-in VL policy with sizes drawn from ``seed`` (hidden 32/64, 1-2 layers, GQA or
    not, tied or not); eval mode, float32."""
    rng = random.Random(seed)
    heads = rng.choice([2, 4])
    spec = ModelConfig(arch=arch, hidden_size=rng.choice([32, 64]), num_hidden_layers=rng.randint(1, 2),
                       num_attention_heads=heads, num_key_value_heads=rng.choice([1, heads // 2, heads]),
                       intermediate_size=rng.choice([64, 96]), tie_word_embeddings=rng.random() < 0.3)
    tokenizer = builtin_tokenizer(arch)
    return builtin_model(tokenizer, spec, seed=seed).eval(), tokenizer, spec


def draw_rows(model, seed: int, n_rows: int = 5):
    """``[(ids, prompt_len)]`` and their images: row 0 text-only, row 1 one image, row 2 three
    images of different sizes, the rest drawn; grids of 2-6 patches a side (28-84 px at patch 14)."""
    rng = random.Random(seed)
    tokens = VisionTokens.from_hf_config(model.config)
    patch = model.config.vision_config.patch_size
    dim = 3 * 2 * patch * patch  # C * temporal_patch * patch**2
    rows, images = [], []
    for r in range(n_rows):
        n_images = [0, 1, 3][r] if r < 3 else rng.randint(0, 2)
        grids = [(1, 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)) for _ in range(n_images)]
        ids = [rng.randint(20, 90) for _ in range(rng.randint(1, 4))]
        for _, h, w in grids:
            ids += [tokens.vision_start_id] + [tokens.image_token_id] * (h * w // 4) + [tokens.vision_end_id]
            ids += [rng.randint(20, 90) for _ in range(rng.randint(0, 3))]
        prompt_len = len(ids)
        ids += [rng.randint(20, 90) for _ in range(rng.randint(2, 6))]
        rows.append((ids, prompt_len))
        grid = torch.tensor(grids, dtype=torch.long).view(-1, 3)
        images.append(ImageInputs.of(torch.randn(int(grid.prod(-1).sum()), dim), grid) if grids else None)
    return rows, RowImages(images)


def pad_rows(rows, side: str):
    """``input_ids, attention_mask, response_mask`` ``[B, L]`` padded on ``side``."""
    width = max(len(ids) for ids, _ in rows)
    ids_t = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids_t)
    response = torch.zeros(len(rows), width)
    for b, (ids, prompt_len) in enumerate(rows):
        start = 0 if side == "right" else width - len(ids)
        ids_t[b, start:start + len(ids)] = torch.tensor(ids)
        mask[b, start:start + len(ids)] = 1
        response[b, start + prompt_len:start + len(ids)] = 1
    return ids_t, mask, response


def hf_logprobs(model, ids, mask, response, images: RowImages, temperature: float):
    """transformers' own padded forward (pixel_values, image_grid_thw, mm_token_type_ids):
    log-probs ``[B, L]`` of the response tokens."""
    tokens = VisionTokens.from_hf_config(model.config)
    inputs = images.concat()
    extra = {} if inputs is None else dict(pixel_values=inputs.pixel_values, image_grid_thw=inputs.grid_thw,
                                            mm_token_type_ids=(ids == tokens.image_token_id).int())
    model.model.rope_deltas = None  # a previous call's cached deltas must not leak into this one
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False, **extra).logits.float()
    model.model.rope_deltas = None
    logq = torch.log_softmax(logits / temperature, -1)
    lp = torch.zeros(ids.shape)
    lp[:, 1:] = logq[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)
    keep = response.clone()
    keep[:, 0] = 0
    return lp * keep
