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
