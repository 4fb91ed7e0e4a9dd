"""Tiny random Qwen2.5-VL / Qwen3-VL models (transformers' own classes), drawn per test.

``draw_config(family, rng)`` draws what changes the computation: heads, KV heads, head_dim,
the mRoPE sections, layers, the vision tower's depth / width / window and full-attention
blocks (Qwen2.5-VL) or deepstack layers (Qwen3-VL), tied embeddings. Images are random
patches of ``t=1`` grids of 2, 4 or 6 patches a side (28..84 px at Qwen2.5-VL's 14 px
patches, 32..96 px at Qwen3-VL's 16), merge size 2. Tests take the seed from
``fresh_seed()`` and name it in their failure messages.
"""
from __future__ import annotations

import random

import _seeds
import torch
import transformers

from hybridrl.data.vision import ImageInputs, VisionTokens
from hybridrl.rollout import EngineSpec, RolloutEngine

VOCAB = 160
IMAGE, VIDEO, START, END = 150, 151, 152, 153
TEXT_IDS = 140  # text tokens are drawn from [0, TEXT_IDS)
FAMILIES = ("qwen2_5_vl", "qwen3_vl")


def fresh_seed() -> int:
    return _seeds.fresh_seed()


def _sections(rng: random.Random, half: int) -> list[int]:
    t = rng.randint(1, half - 2)
    h = rng.randint(1, half - t - 1)
    return [t, h, half - t - h]


def draw_config(family: str, rng: random.Random, **text_overrides):
    heads = rng.choice([2, 4])
    kv = rng.choice([k for k in (1, 2, heads) if heads % k == 0])
    head_dim = rng.choice([8, 12, 16]) if family == "qwen3_vl" else rng.choice([8, 16])
    hidden = heads * head_dim if family == "qwen2_5_vl" else rng.choice([32, 48, 64])
    layers = rng.randint(1, 2)
    text = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, intermediate_size=rng.choice([48, 96]), max_position_embeddings=512,
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": rng.choice([1e4, 1e6]),
                                                    "mrope_section": _sections(rng, head_dim // 2)})
    if family == "qwen3_vl":
        text["head_dim"] = head_dim
    text.update(text_overrides)
    depth = rng.randint(1, 2)
    vwidth, vheads = rng.choice([(32, 2), (32, 4), (48, 2)])
    vision = dict(depth=depth, hidden_size=vwidth, num_heads=vheads, intermediate_size=rng.choice([48, 64]),
                  out_hidden_size=text["hidden_size"], spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if family == "qwen2_5_vl":
        vision.update(patch_size=14, window_size=rng.choice([56, 112]),
                      fullatt_block_indexes=sorted(rng.sample(range(depth), rng.randint(0, depth))))
        cls = transformers.Qwen2_5_VLConfig
    else:
        ds = sorted(rng.sample(range(depth), rng.randint(0, min(depth, layers))))
        vision.update(patch_size=16, num_position_embeddings=rng.choice([16, 36]), deepstack_visual_indexes=ds)
        cls = transformers.Qwen3VLConfig
    return cls(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
               vision_start_token_id=START, vision_end_token_id=END,
               tie_word_embeddings=rng.random() < 0.3)


def hf_model(cfg, seed: int = 0, dtype=torch.float32):
    """Weights large enough that logits are far from uniform and greedy decoding is not degenerate."""
    torch.manual_seed(seed)
    cls = (transformers.Qwen2_5_VLForConditionalGeneration if cfg.model_type == "qwen2_5_vl"
           else transformers.Qwen3VLForConditionalGeneration)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.1)
    return model.to(dtype).eval()


def image(cfg, rng: random.Random, gen: torch.Generator) -> ImageInputs:
    h, w = rng.choice([2, 4, 6]), rng.choice([2, 4, 6])
    v = cfg.vision_config
    width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    return ImageInputs.of(torch.randn(h * w, width, generator=gen), torch.tensor([[1, h, w]]))


def tokens(cfg) -> VisionTokens:
    return VisionTokens.from_hf_config(cfg)


def prompt(cfg, rng: random.Random, n_images: int, gen: torch.Generator) -> tuple[list[int], ImageInputs | None]:
    """Text with ``n_images`` images (each ``<start> image tokens <end>``, sometimes two back to back)."""
    ids, images = [rng.randrange(TEXT_IDS) for _ in range(rng.randint(1, 5))], []
    for _ in range(n_images):
        im = image(cfg, rng, gen)
        n = im.features_per_image(2)[0]
        ids += [START] + [IMAGE] * n + [END] + [rng.randrange(TEXT_IDS) for _ in range(rng.randint(0, 4))]
        images.append(im)
    ids += [rng.randrange(TEXT_IDS) for _ in range(rng.randint(1, 4))]
    return ids, ImageInputs.concat(images)


def engine(cfg, hf=None, *, max_batch_size=6, max_seq_len=160, dtype=torch.float32, quantization=None, **kw):
    spec = EngineSpec(max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype, quantization=quantization)
    eng = RolloutEngine(cfg, spec, **kw)
    if hf is not None:
        eng.load_weights(hf.named_parameters())
    return eng


def hf_batch(rows: list[tuple[list[int], ImageInputs | None]], pad: int = 0):
    """A left-padded transformers batch: input_ids, attention_mask, mm_token_type_ids and,
    when any row has images, pixel_values / image_grid_thw in row order."""
    L = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), L), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, (ids, _) in enumerate(rows):
        input_ids[b, L - len(ids):] = torch.tensor(ids)
        mask[b, L - len(ids):] = 1
    batch = dict(input_ids=input_ids, attention_mask=mask, mm_token_type_ids=(input_ids == IMAGE).long() * mask)
    images = ImageInputs.concat([im for _, im in rows])
    if images is not None:
        batch.update(pixel_values=images.pixel_values, image_grid_thw=images.grid_thw)
    return batch


def tp_worker(rank: int, world: int, port: int, family: str, seed: int, out: str) -> None:
    """One rank of a tensor-parallel VL engine next to the whole engine (gloo, CPU): logits of a
    left-padded mixed batch and greedy answers with images; the result saved to ``out.rank``."""
    import os

    import torch.distributed as dist

    from hybridrl.data.vision import RowImages
    from hybridrl.refit import refit_from_model
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.layers.tensor_parallel import TensorParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cfg = draw_config(family, rng)
    rows = [prompt(cfg, rng, n, gen) for n in (0, 1, 2)]
    hf = hf_model(cfg, seed=seed % 1000)
    whole = engine(cfg, hf)
    sharded = engine(cfg, tensor_parallel=TensorParallel(rank, world, dist.group.WORLD))
    refit_from_model(sharded, hf, verify=True)
    batch = hf_batch(rows)
    images = RowImages([im for _, im in rows])
    mask = batch["attention_mask"].bool()
    ref = whole.logits(batch["input_ids"], batch["attention_mask"], images)[mask]
    got = sharded.logits(batch["input_ids"], batch["attention_mask"], images)[mask]
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(IMAGE, VIDEO, START, END))
    a = whole.generate([ids for ids, _ in rows], params, images=[im for _, im in rows])
    b = sharded.generate([ids for ids, _ in rows], params, images=[im for _, im in rows])
    torch.save(dict(logit_gap=float((ref - got).abs().max()), logit_scale=float(ref.abs().max()),
                    greedy_equal=a.response_token_ids == b.response_token_ids,
                    logprob_gap=float((a.logprobs - b.logprobs).abs().max()),
                    tower_whole=all(p.shape == q.shape for p, q in zip(sharded.model.model.visual.parameters(),
                                                                       whole.model.model.visual.parameters()))),
               f"{out}.{rank}")
    dist.barrier()
    os._exit(0)
