"""The built-in engine under exact numerics (``EngineSpec.exact``) for the vision-language
families (Qwen2.5-VL, Qwen3-VL): every response token's log-prob is bitwise the trainer's
recomputation (``logprobs_in_microbatches(..., images=...)`` under ``batch_invariant()``), in
batches mixing text-only rows with rows of one or two images of other sizes.

What makes it hold (docs/exact.md): both sides run transformers' own vision tower under the
exact mode (its GEMMs row-tiled, its patch embedding as a row-tiled GEMM: ``ops.patch_conv``,
its attention per image / window as transformers splits it), whatever images share the call;
the engine's mRoPE tables on the SIMD path; Qwen3-VL's deepstack features added in
transformers' order. Configs drawn per run (``tests/rollout/_vl.py``), seeds in the messages.
"""

from __future__ import annotations

import random

import pytest
import torch

from _engine_round_trip import exact_engine
from hybridrl.data.vision import RowImages
from hybridrl.exact import batch_invariant
from hybridrl.exact.ops import exact_log_softmax, patch_conv
from hybridrl.job.model_factory import cast_as_loaded
from hybridrl.rollout import SamplingParams
from hybridrl.trainer.logprobs import logprobs_in_microbatches
from tests.rollout import _vl

STOP = (_vl.IMAGE, _vl.VIDEO, _vl.START, _vl.END)  # a sampled vision token ends a VL sample


def draw_vl(family: str, seed: int, dtype: torch.dtype, n: int):
    """A random-init VL policy of ``family`` and ``n`` prompts (0, 1 or 2 images of 2..6 patches a
    side each); (model, prompts, images, description)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cfg = _vl.draw_config(family, rng)
    if family == "qwen3_vl" and not cfg.vision_config.deepstack_visual_indexes:
        cfg.vision_config.deepstack_visual_indexes = [0]  # always a deepstack layer (its sum order is tested)
    model = cast_as_loaded(_vl.hf_model(cfg, seed % 1000), dtype).eval()
    rows = [_vl.prompt(cfg, rng, (0, 1, 2)[i % 3] if i < 3 else rng.choice([0, 1, 1, 2]), gen) for i in range(n)]
    return model, [ids for ids, _ in rows], [im for _, im in rows], f"{family} {dtype} seed={seed}"


def sampling(rng: random.Random, n: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=rng.randint(3, 14), seed=i, stop_token_ids=STOP, **kw) for i in range(n)]


def trainer_logprobs(model, ro, images, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad(), batch_invariant():
        old, _ = logprobs_in_microbatches(model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                          temperature=temperature, max_tokens=300, images=RowImages(images))
    return old


def assert_bitwise(model, ro, images, what: str, min_tokens: int = 40, temperature: float = 1.0) -> None:
    old, mask = trainer_logprobs(model, ro, images, temperature), ro.response_mask.bool()
    assert int(mask.sum()) >= min_tokens, f"{what}: only {int(mask.sum())} response tokens"
    differ = old[mask] != ro.logprobs[mask]
    assert not differ.any(), (f"{what}: {int(differ.sum())} of {int(mask.sum())} tokens differ from the trainer's, "
                              f"max {float((old - ro.logprobs)[mask].abs().max()):.3g}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", _vl.FAMILIES)
def test_vl_families_are_bitwise_on_policy(family, dtype):
    """18 requests through 5 rows (rows join and leave at every step), top-p 0.9."""
    seed = _vl.fresh_seed()
    model, prompts, images, what = draw_vl(family, seed, dtype, 18)
    engine = exact_engine(model, max_batch_size=5, max_seq_len=200)
    ro = engine.generate(prompts, sampling(random.Random(seed), 18, top_p=0.9), images=images)
    assert_bitwise(model, ro, images, what)


@pytest.mark.parametrize("family", _vl.FAMILIES)
def test_images_split_across_prefill_chunks(family):
    """A prefill budget of 8 tokens: an image's tokens land in several chunks (each chunk encodes
    the image again and takes its part of the features); still bitwise."""
    seed = _vl.fresh_seed()
    model, prompts, images, what = draw_vl(family, seed, torch.bfloat16, 10)
    engine = exact_engine(model, max_batch_size=4, max_seq_len=200, max_prefill_tokens=8)
    assert engine.chunked_prefill
    ro = engine.generate(prompts, sampling(random.Random(seed), 10), images=images)
    assert_bitwise(model, ro, images, what, min_tokens=20)


def test_a_request_alone_equals_it_among_others():
    seed = _vl.fresh_seed()
    model, prompts, images, what = draw_vl(random.Random(seed).choice(_vl.FAMILIES), seed, torch.float32, 12)
    params = sampling(random.Random(seed), 12, temperature=0.8)
    engine = exact_engine(model, max_batch_size=6, max_seq_len=200)
    batched = engine.generate(prompts, params, images=images)
    for i in (1, 2, 10):  # one image, two images, drawn
        alone = engine.generate([prompts[i]], [params[i]], images=[images[i]])
        row, own = batched.response_mask[i].bool(), alone.response_mask[0].bool()
        assert batched.input_ids[i][row].tolist() == alone.input_ids[0][own].tolist(), what
        assert torch.equal(batched.logprobs[i][row], alone.logprobs[0][own]), what


def test_continuation_with_a_new_image_from_a_retained_prefix():
    """Turn 1 (with its images) retained; turn 2 = turn 1 + text + a new image extends the cached
    KV (the cached images are not encoded again) and == the trainer scoring the whole conversation."""
    from hybridrl.data.vision import ImageInputs
    from hybridrl.rollout.rollouts import rollouts_from_outputs

    seed = _vl.fresh_seed()
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed + 1)
    family = rng.choice(_vl.FAMILIES)
    model, prompts, images, what = draw_vl(family, seed, torch.float32, 5)
    engine = exact_engine(model, max_batch_size=4, max_seq_len=240)
    for i in range(5):
        engine.add_request(f"t1-{i}", prompts[i], SamplingParams(max_tokens=rng.randint(2, 8), seed=i,
                                                                  stop_token_ids=STOP), retain=True, images=images[i])
    turn1 = engine.run_until_finished([f"t1-{i}" for i in range(5)])
    later = []
    for i in range(5):
        o = turn1[f"t1-{i}"]
        extra, new = _vl.prompt(model.config, rng, 1, gen)
        later.append(ImageInputs.concat([images[i], new]))
        engine.add_request(f"t2-{i}", o.prompt_token_ids + o.token_ids + extra,
                           SamplingParams(max_tokens=rng.randint(3, 10), seed=100 + i, stop_token_ids=STOP),
                           parent=f"t1-{i}", images=later[-1])
    turn2 = engine.run_until_finished([f"t2-{i}" for i in range(5)])
    assert all(turn2[f"t2-{i}"].cached_tokens > 0 for i in range(5)), f"{what}: no prefix was reused"
    assert_bitwise(model, rollouts_from_outputs([turn2[f"t2-{i}"] for i in range(5)]), later, what, min_tokens=10)


def test_full_sequence_logits_with_images_match_the_rollout_bits():
    """``engine.logits`` with images (rows left-padded here) gives the sampled tokens the rollout's log-probs."""
    seed = _vl.fresh_seed()
    model, prompts, images, what = draw_vl(random.Random(seed).choice(_vl.FAMILIES), seed, torch.float32, 8)
    engine = exact_engine(model, max_batch_size=8, max_seq_len=200)
    ro = engine.generate(prompts, sampling(random.Random(seed), 8), images=images)
    shift = (~ro.attention_mask.bool()).sum(1)  # right-aligned copy: left padding
    left, left_mask, resp, want = ([torch.roll(r, int(s)) for r, s in zip(t, shift)]
                                   for t in (ro.input_ids, ro.attention_mask, ro.response_mask, ro.logprobs))
    left, left_mask = torch.stack(left), torch.stack(left_mask)
    with torch._C.DisableTorchFunction():
        logp = exact_log_softmax(engine.logits(left, left_mask, RowImages(images)))
    got = logp[:, :-1].gather(-1, left[:, 1:, None]).squeeze(-1)
    resp, want = torch.stack(resp)[:, 1:].bool(), torch.stack(want)[:, 1:]
    assert torch.equal(got[resp], want[resp]), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patch_conv_is_a_row_tiled_gemm(dtype):
    """The exact form of a patch embedding: a patch's bits do not depend on how many patches share
    the call (oneDNN's bf16 Conv3d at Qwen2.5-VL's 1280 filters: 4 patches alone differed); any
    other convolution is left to torch."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1280, 3, 2, 14, 14, generator=g) * 0.02).to(dtype)
    x = torch.randn(400, 3, 2, 14, 14, generator=g).to(dtype)
    with torch.no_grad(), batch_invariant():
        many = torch.nn.functional.conv3d(x, w, None, stride=(2, 14, 14))
        for n, start in ((1, 0), (4, 0), (4, 37), (64, 100)):
            assert torch.equal(torch.nn.functional.conv3d(x[start:start + n], w, None, stride=(2, 14, 14)),
                               many[start:start + n])
    assert many.shape == (400, 1280, 1, 1, 1)
    assert patch_conv(torch.randn(2, 3, 8, 8), torch.randn(4, 3, 2, 2), stride=2) is None  # several outputs
