"""Qwen2.5-VL / Qwen3-VL in the built-in engine vs transformers, and the image bookkeeping.

Configs are drawn fresh per run (``_vl.draw_config``; the seed is in every failure message,
``pytest --seed N`` replays it). fp32 tolerances: the engine and transformers run the same
fp32 math in another order (fused q/k/v and gate/up, our rope tables, SDPA vs masked
kernels), so logits agree to ~1e-6 of their scale; 1e-4 relative leaves two orders of
margin, and is the bound the text families are held to (test_numerics.py).
"""

import random

import pytest
import torch

from hybridrl.data.vision import ImageInputs, ImageTokenMismatch, RowImages
from hybridrl.refit import refit_from_model
from hybridrl.rollout import SamplingParams
from tests.rollout import _vl as vl

SPECIAL = (vl.IMAGE, vl.VIDEO, vl.START, vl.END)
# a sampled <|image_pad|> ends the answer (never fed back), so every fed sequence keeps its
# image tokens exactly where its images are; the bookkeeping tests cover the sampled case
GREEDY = dict(temperature=0.0, stop_token_ids=SPECIAL)


def _close(ours, ref, seed, what, scale=None):
    """Within 1e-4 of ``scale`` (default: the largest |ref|; log-probs: their logits' scale)."""
    ref = ref.to(torch.float32)
    scale = float(ref.abs().max()) if scale is None else scale
    err = float((ours - ref).abs().max())
    assert err <= 1e-4 * scale, f"{what}: max error {err:.3g} > 1e-4 x {scale:.3g} (seed {seed})"


def _draw(family, n_rows=(0, 1, 2, 3)):
    seed = vl.fresh_seed()
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cfg = vl.draw_config(family, rng)
    rows = [vl.prompt(cfg, rng, n, gen) for n in n_rows]
    return seed, cfg, rng, gen, rows


def _hf_logits(hf, rows):
    """transformers' forward over a left-padded batch, in float64: [B, L, V] and the mask."""
    batch = vl.hf_batch(rows)
    ref = hf.double()
    try:
        with torch.no_grad():
            out = ref(**{k: v.double() if v.is_floating_point() else v for k, v in batch.items()}).logits
    finally:
        hf.float()
    return out, batch["attention_mask"].bool()


def _record_decode(eng, monkeypatch):
    """Every decode step's logits, by request id."""
    seen: dict[str, list[torch.Tensor]] = {}
    real = eng.runner.decode

    def decode(tokens, positions, kv_len, aligned=False, rope_deltas=None):
        out = real(tokens, positions, kv_len, aligned, rope_deltas)
        for s, row in zip(eng.scheduler.batch.seqs, out):
            seen.setdefault(s.request_id, []).append(row.clone())
        return out

    monkeypatch.setattr(eng.runner, "decode", decode)
    return seen


@pytest.mark.parametrize("family", vl.FAMILIES)
def test_logits_match_transformers_left_padded_mixed_batch(family):
    seed, cfg, _, _, rows = _draw(family)
    hf = vl.hf_model(cfg, seed=1)
    eng = vl.engine(cfg, hf)
    ref, mask = _hf_logits(hf, rows)
    batch = vl.hf_batch(rows)
    ours = eng.logits(batch["input_ids"], batch["attention_mask"], RowImages([im for _, im in rows]))
    _close(ours[mask], ref[mask], seed, "left-padded logits")
    for b, (ids, im) in enumerate(rows):  # each row alone, unpadded (right padding: plain causal)
        alone = eng.logits(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), RowImages([im]))
        _close(alone[0], ref[b][mask[b]], seed, f"row {b} alone")


@pytest.mark.parametrize("family", vl.FAMILIES)
def test_prefill_and_decode_match_transformers_and_the_engines_own_prefill(family, monkeypatch):
    """Continuous batching over text-only rows and rows with one or several images of different
    sizes: every prefill and decode step's logits == transformers' forward over the fed
    sequences (left-padded batch) and == the engine's own no-cache forward; greedy tokens ==
    transformers' argmax at every step."""
    seed, cfg, _, _, rows = _draw(family)
    hf = vl.hf_model(cfg, seed=2)
    eng = vl.engine(cfg, hf, max_batch_size=3)  # 4 prompts, 3 rows: one waits and joins later
    decoded = _record_decode(eng, monkeypatch)
    params = SamplingParams(max_tokens=6, **GREEDY)
    out = eng.generate([ids for ids, _ in rows], params, images=[im for _, im in rows])
    assert out.images is not None and [r is im for r, (_, im) in zip(out.images, rows)] == [True] * len(rows)
    fed = [(ids + resp[:-1], im) for (ids, im), resp in zip(rows, out.response_token_ids)]
    ref, mask = _hf_logits(hf, fed)
    batch = vl.hf_batch(fed)
    own = eng.logits(batch["input_ids"], batch["attention_mask"], RowImages([im for _, im in fed]))
    for b, ((ids, _), resp) in enumerate(zip(rows, out.response_token_ids)):
        ref_b, own_b = ref[b][mask[b]], own[b][mask[b]]
        steps = ref_b[len(ids) - 1:]  # the logits that sampled each response token
        assert steps.shape[0] == len(resp)
        logp = torch.log_softmax(steps, dim=-1)[torch.arange(len(resp)), resp]
        _close(out.logprobs[b, len(ids):len(ids) + len(resp)], logp, seed, f"row {b} log-probs",
               scale=float(steps.abs().max()))
        top2 = steps.topk(2, dim=-1).values
        for t, tok in enumerate(resp):
            if float(top2[t, 0] - top2[t, 1]) > 1e-3 * float(steps.abs().max()):
                assert tok == int(steps[t].argmax()), f"row {b} step {t}: greedy token differs (seed {seed})"
        got = decoded.get(f"generate-0-{b}", [])  # one per decode step (the first token is the prefill's)
        assert len(got) == len(resp) - 1, (b, len(got), seed)
        if got:
            got = torch.stack(got)
            _close(got, ref_b[len(ids):len(ids) + len(resp) - 1], seed, f"row {b} decode vs transformers")
            _close(got, own_b[len(ids):len(ids) + len(resp) - 1], seed, f"row {b} decode vs own prefill")


def _run(eng, rid, ids, params, **kw):
    eng.add_request(rid, ids, params, **kw)
    return eng.run_until_finished([rid])[rid]


def _logit_scale(eng, ids, images) -> float:
    return float(eng.logits(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), RowImages([images]))
                 .abs().max())


def _continuation(cfg, rng, gen, ids, im, first):
    """The next turn of a conversation: the first turn's prompt and answer, text and one more
    image; its images (the first turn's, then the new one) and placeholders (the answer is text)."""
    new_ids, new_im = vl.prompt(cfg, rng, 1, gen)
    child = ids + first.token_ids + new_ids
    placeholders = [True] * len(ids) + [False] * len(first.token_ids) + [True] * len(new_ids)
    return child, ImageInputs.concat([im, new_im]), placeholders, new_im


@pytest.mark.parametrize("family", vl.FAMILIES)
def test_extend_after_a_retained_prefix_with_images_equals_a_full_prefill_without_reencoding(family):
    seed, cfg, rng, gen, rows = _draw(family, n_rows=(2,))
    hf = vl.hf_model(cfg, seed=3)
    eng = vl.engine(cfg, hf)
    ids, im = rows[0]
    params = SamplingParams(max_tokens=4, **GREEDY)
    first = _run(eng, "t1", ids, params, retain=True, images=im)
    child, images, placeholders, new_im = _continuation(cfg, rng, gen, ids, im, first)
    counter = eng.model.model.vision_counter
    before = (counter.calls, counter.images, counter.patches)
    second = _run(eng, "t2", child, params, parent="t1", images=images, placeholders=placeholders)
    assert second.cached_tokens == len(ids) + len(first.token_ids) - 1, seed
    assert (counter.calls - before[0], counter.images - before[1], counter.patches - before[2]) == (
        1, 1, new_im.pixel_values.shape[0]), f"only the new image is encoded (seed {seed})"
    fresh = vl.engine(cfg, hf)
    full = _run(fresh, "f", child, params, images=images, placeholders=placeholders)
    assert full.cached_tokens == 0 and fresh.model.model.vision_counter.images == images.n_images
    assert second.token_ids == full.token_ids, f"extend != full prefill (seed {seed})"
    _close(torch.tensor(second.logprobs), torch.tensor(full.logprobs), seed, "extend log-probs",
           scale=_logit_scale(fresh, child, images))


@pytest.mark.parametrize("family", vl.FAMILIES)
def test_same_ids_with_other_images_are_neither_deduplicated_nor_a_prefix_hit(family):
    seed, cfg, rng, gen, rows = _draw(family, n_rows=(1,))
    hf = vl.hf_model(cfg, seed=4)
    ids, im = rows[0]
    other = ImageInputs.of(torch.randn(im.pixel_values.shape, generator=gen), im.grid_thw)  # same grid
    assert other.keys != im.keys
    eng = vl.engine(cfg, hf)
    params = SamplingParams(max_tokens=3, **GREEDY)
    out = eng.generate([ids, ids, ids], params, images=[im, other, im])
    counter = eng.model.model.vision_counter
    assert (counter.calls, counter.images) == (1, 2), f"im and other once each, one tower call (seed {seed})"
    assert out.response_token_ids[0] == out.response_token_ids[2] and torch.equal(out.logprobs[0], out.logprobs[2])
    for row, image in ((0, im), (1, other)):
        alone = vl.engine(cfg, hf).generate([ids], params, images=[image])
        assert alone.response_token_ids[0] == out.response_token_ids[row], f"row {row} (seed {seed})"
    mask = torch.ones(2, len(ids), dtype=torch.long)
    last = eng.logits(torch.tensor([ids, ids]), mask, RowImages([im, other]))[:, -1]
    assert not torch.allclose(last[0], last[1], rtol=1e-3, atol=1e-3), f"the image matters (seed {seed})"
    # a continuation whose first image is another picture: the prefix serves nothing from there on
    parent = _run(eng, "p", ids, params, retain=True, images=im)
    child, images, placeholders, _ = _continuation(cfg, rng, gen, ids, other, parent)
    got = _run(eng, "c", child, params, parent="p", images=images, placeholders=placeholders)
    assert got.cached_tokens <= ids.index(vl.IMAGE), f"a prefix hit over another image (seed {seed})"
    full = _run(vl.engine(cfg, hf), "f", child, params, images=images, placeholders=placeholders)
    assert got.token_ids == full.token_ids, seed


def _state(eng) -> dict[str, torch.Tensor]:
    return {n: t for n, t in eng.named_state_tensors() if not n.startswith("kv_cache")}


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("family", vl.FAMILIES)
def test_refit_a_to_b_is_bitwise_a_fresh_load_of_b_vision_tower_included(family, quantization):
    seed, cfg, _, _, rows = _draw(family, n_rows=(0, 2))
    hf_a, hf_b = vl.hf_model(cfg, seed=5), vl.hf_model(cfg, seed=6)
    refitted = vl.engine(cfg, hf_a, quantization=quantization)
    trainer_names = set(hf_b.state_dict()) - refitted.weight_routes.ignored
    assert refitted.expected_weight_names() == trainer_names, seed
    assert any(n.startswith("model.visual.") for n in trainer_names)
    before = {n: t.data_ptr() for n, t in refitted.named_state_tensors()}
    refit_from_model(refitted, hf_b, verify=True)
    assert {n: t.data_ptr() for n, t in refitted.named_state_tensors()} == before, "refit moved a tensor"
    fresh = vl.engine(cfg, hf_b, quantization=quantization)
    state = _state(refitted)
    for name, t in _state(fresh).items():
        assert torch.equal(state[name], t), f"{name} (seed {seed})"
    visual = dict(hf_b.named_parameters())
    for name, p in refitted.model.named_parameters():
        if name.startswith("model.visual."):  # full precision whatever the language model is
            assert p.dtype == torch.float32 and torch.equal(p, visual[name]), name
    if quantization == "fp8":
        qkv = refitted.model.model.language_model.layers[0].self_attn.qkv_proj.weight
        assert qkv.dtype == torch.float8_e4m3fn
    params = SamplingParams(max_tokens=5, **GREEDY)
    a = refitted.generate([ids for ids, _ in rows], params, images=[im for _, im in rows])
    b = fresh.generate([ids for ids, _ in rows], params, images=[im for _, im in rows])
    assert a.response_token_ids == b.response_token_ids and torch.equal(a.logprobs, b.logprobs), seed


@pytest.mark.parametrize("family", vl.FAMILIES)
def test_refit_mid_answer_recomputes_with_the_images_encoded_again(family):
    seed, cfg, _, _, rows = _draw(family, n_rows=(2,))
    hf_a, hf_b = vl.hf_model(cfg, seed=7), vl.hf_model(cfg, seed=8)
    ids, im = rows[0]
    eng = vl.engine(cfg, hf_a)
    eng.add_request("r", ids, SamplingParams(max_tokens=6, temperature=0.0), images=im)
    eng.step()
    eng.step()
    counter = eng.model.model.vision_counter
    assert counter.images == 2
    refit_from_model(eng, hf_b)
    out = eng.run_until_finished(["r"])["r"]
    assert counter.images == 4, f"recompute encodes the images again (seed {seed})"
    n_a = out.token_versions.count(1)
    assert n_a == 2 and out.token_versions[n_a:] == [2] * (len(out.token_ids) - n_a)
    # what B answers after the prompt and A's tokens (as text)
    head = ids + out.token_ids[:n_a]
    b = _run(vl.engine(cfg, hf_b), "b", head, SamplingParams(max_tokens=4, temperature=0.0), images=im,
             placeholders=[True] * len(ids) + [False] * n_a)
    assert b.token_ids == out.token_ids[n_a:], seed
    _close(torch.tensor(b.logprobs), torch.tensor(out.logprobs[n_a:]), seed, "after refit",
           scale=_logit_scale(eng, ids, im))


@pytest.mark.parametrize("family", vl.FAMILIES)
def test_image_token_mismatch_is_refused_in_one_line_with_the_engine_untouched(family):
    seed, cfg, rng, gen, rows = _draw(family, n_rows=(2,))
    ids, im = rows[0]
    eng = vl.engine(cfg, vl.hf_model(cfg, seed=9))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    bigger = ImageInputs.of(torch.randn(8 * 8, im.pixel_values.shape[1], generator=gen), torch.tensor([[1, 8, 8]]))
    cases = {"no images": None, "one image missing": im.select(0, 1), "an extra image": ImageInputs.concat([im, bigger]),
             "another size": ImageInputs.concat([im.select(0, 1), bigger])}
    for what, bad in cases.items():
        with pytest.raises(ImageTokenMismatch) as e:
            eng.add_request("r", ids, params, images=bad)
        assert "\n" not in str(e.value) and "'r'" in str(e.value), (what, str(e.value))
        assert not eng.has_unfinished_requests() and not eng.scheduler.live, what
        with pytest.raises(ImageTokenMismatch):
            eng.generate([ids], params, images=[bad])
        assert not eng.has_unfinished_requests() and not eng.scheduler.live, what
    # an <|image_pad|> outside <|vision_start|> ... <|vision_end|> (a sampled one) is text
    ok = _run(eng, "r", ids + [vl.IMAGE], params, images=im)
    assert ok.finish_reason == "length" and ok.images is im
    with pytest.raises(ImageTokenMismatch):  # unless the caller says it is a placeholder
        eng.add_request("r2", ids + [vl.IMAGE], params, images=im, placeholders=[True] * (len(ids) + 1))
    assert not eng.scheduler.live
    text = vl.engine(cfg, vl.hf_model(cfg, seed=9))
    assert _run(text, "t", [1, 2, 3], params).images is None
    from tests.rollout.conftest import make_config
    from hybridrl.rollout import EngineSpec, RolloutEngine
    plain = RolloutEngine(make_config("qwen2"), EngineSpec(max_batch_size=1, max_seq_len=16))
    with pytest.raises(ValueError, match="takes none") as e:
        plain.add_request("x", [1, 2], params, images=im)
    assert "\n" not in str(e.value) and not plain.scheduler.live


@pytest.mark.parametrize("family", vl.FAMILIES)
def test_from_pretrained_reads_the_saved_vl_layout_and_memory_counts_the_tower(family, tmp_path):
    """transformers 5 saves Qwen2.5-VL in the released layout (``visual.*``, ``model.layers.*``)
    and Qwen3-VL in its own (``model.visual.*``, ``model.language_model.*``): both load."""
    from hybridrl.rollout import EngineSpec, RolloutEngine

    seed, cfg, _, _, rows = _draw(family, n_rows=(1,))
    hf = vl.hf_model(cfg, seed=10)
    hf.save_pretrained(tmp_path)
    loaded = RolloutEngine.from_pretrained(str(tmp_path), EngineSpec(max_batch_size=2, max_seq_len=96))
    direct = vl.engine(cfg, hf, max_batch_size=2, max_seq_len=96)
    state = _state(direct)
    for name, t in _state(loaded).items():
        assert torch.equal(state[name], t), f"{name} (seed {seed})"
    tower = sum(p.numel() * p.element_size() for p in direct.model.model.visual.parameters())
    params = {id(p): p for p in direct.model.parameters()}.values()
    assert tower > 0 and direct.memory.weights == sum(p.numel() * p.element_size() for p in params)
