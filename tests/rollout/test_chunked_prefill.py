"""Chunked prefill (hybridrl/rollout/core/chunked_prefill.py): a prompt 3-9x the prefill budget,
prefilled a chunk per step among running decoders, against the same request prefilled whole
(``chunked_prefill=False``: admitted alone, one prefill), for each model family.

Tolerance: fp32. A chunked prefill computes the same function over the same keys, but as a
prefill of the first chunk plus masked extends: its GEMMs run over other row counts (other
blocking) and its attention over split query blocks with a mask instead of the causal
kernel, so sums are reordered — a few ulp per op, carried through the layers. Log-probs
therefore agree to ``ATOL`` (measured: at most 1.2e-6 over 24 draws of these models),
greedy tokens exactly.
"""

import random
import types

import _seeds
import pytest
import torch

from hybridrl.data.vision import split_runs
from hybridrl.refit import refit_from_model
from hybridrl.refit.transport import named_trainer_tensors
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.rollout.routing import enable_routing_record
from tests.rollout import _deepseek, _deepseek_v4, _vl
from tests.rollout.conftest import FAMILIES, VOCAB, make_config, make_hf_model
from tests.rollout.test_moe import make_moe_config, make_moe_hf_model

ATOL = 1e-4
MAX_SEQ = 192
KINDS = ["dense", "qwen_moe", "deepseek_v3", "vl"]


def _model(kind: str, rng: random.Random):
    """(hf model, engine factory, text vocabulary) of a config drawn for this run."""
    seed = rng.randrange(1 << 20)
    if kind == "dense":
        hf = make_hf_model(make_config(rng.choice(FAMILIES), max_position_embeddings=256), seed=seed)
        load, vocab = hf.named_parameters, VOCAB
    elif kind == "qwen_moe":
        hf = make_moe_hf_model(make_moe_config(rng.choice(["qwen3_moe", "qwen2_moe"]), max_position_embeddings=256),
                               seed=seed)
        load, vocab = hf.named_parameters, VOCAB
    elif kind == "deepseek_v3":
        hf = _deepseek.hf_model(_deepseek.draw_config(rng), seed=seed)
        load, vocab = (lambda: named_trainer_tensors(hf)), _deepseek.VOCAB
    else:
        hf = _vl.hf_model(_vl.draw_config(rng.choice(_vl.FAMILIES), rng), seed=seed)
        load, vocab = hf.named_parameters, _vl.TEXT_IDS

    def make(budget: int, chunked: bool = True, record: bool = False, **kw) -> RolloutEngine:
        engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=4, max_seq_len=MAX_SEQ),
                               max_prefill_tokens=budget, **kw)
        engine.chunked_prefill = chunked
        if record:
            enable_routing_record(engine)
        engine.load_weights(load())
        return engine

    return hf, make, vocab


def _long_prompt(kind, hf, rng: random.Random, length: int, vocab: int):
    """(ids, images): ``length`` tokens or a few more (vision-language: images among text)."""
    if kind != "vl":
        return [rng.randrange(vocab) for _ in range(length)], None
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    ids, images = [], []
    while len(ids) < length - 4:
        ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        im = _vl.image(hf.config, rng, gen)
        ids += [_vl.START] + [_vl.IMAGE] * im.features_per_image(2)[0] + [_vl.END]
        images.append(im)
    ids += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
    return ids, type(images[0]).concat(images)


def _scenario(engine, long, images, decoders, max_tokens=8):
    """Two decoders run; the long prompt arrives after 2 steps. (outputs, every step's output)."""
    for i, p in enumerate(decoders):
        engine.add_request(f"d{i}", p, SamplingParams(temperature=0.0, max_tokens=40))
    steps = [engine.step(), engine.step()]
    engine.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=max_tokens), images=images)
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return {o.request_id: o for s in steps for o in s.finished}, steps


def _same(a, b, what):
    assert a.token_ids == b.token_ids, what
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=ATOL, msg=what)


def _prefill_logprobs(engine, out) -> torch.Tensor:
    """Log-probs of ``out``'s tokens from one no-cache forward of prompt + response."""
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    logits = engine.logits(ids, torch.ones_like(ids))
    L = len(out.prompt_token_ids)
    lp = torch.log_softmax(logits[0, L - 1:-1], dim=-1)
    return lp.gather(1, torch.tensor(out.token_ids).view(-1, 1)).view(-1)


@pytest.mark.parametrize("kind", KINDS)
def test_a_chunked_prefill_gives_what_one_prefill_gives(kind):
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    hf, make, vocab = _model(kind, rng)
    budget = rng.randint(8, 16)
    long, images = _long_prompt(kind, hf, rng, budget * rng.randint(3, 9), vocab)
    decoders = [[rng.randrange(vocab) for _ in range(rng.randint(2, budget // 2))] for _ in range(2)]
    engine, encoded = make(budget), []
    if images is not None:  # count the images each vision-tower call encodes
        encode = engine.model.model.encode
        engine.model.model.encode = lambda im: (encoded.append(im.n_images), encode(im))[1]
    chunked, steps = _scenario(engine, long, images, decoders)
    whole, whole_steps = _scenario(make(budget, chunked=False), long, images, decoders)
    what = f"{kind}, seed {seed}, budget {budget}, prompt {len(long)}"
    for rid in ("long", "d0", "d1"):
        _same(chunked[rid], whole[rid], f"{rid}: {what}")
    assert max(s.prefilled_tokens for s in whole_steps) == len(long), what  # the baseline: one whole prefill
    spans = split_runs(long, images, _vl.tokens(hf.config)) if images is not None else []
    fed, ends = 0, []
    for s in steps[2:]:
        if s.prefilled_tokens:
            fed += s.prefilled_tokens
            ends.append(fed)
        if not spans:
            assert s.prefilled_tokens <= budget, what  # never more than the budget in one step
    assert fed == len(long), what
    if spans:  # a chunk runs on to the end of an image it would cut; each image is encoded once
        assert len(ends) >= 2 and sum(encoded) == images.n_images, what
        assert not any(a < end < e for end in ends for a, e in spans), f"a chunk cut an image: {what}"
    else:
        assert len(ends) == -(-len(long) // budget), what
    if images is None:  # decode == prefill still holds
        engine = make(budget)
        ref = _prefill_logprobs(engine, chunked["long"])
        torch.testing.assert_close(torch.tensor(chunked["long"].logprobs), ref, rtol=0, atol=ATOL, msg=what)


def test_running_requests_get_a_token_every_step_while_a_long_prompt_is_chunked():
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    _, make, vocab = _model("dense", rng)
    budget = rng.randint(8, 16)
    long = [rng.randrange(vocab) for _ in range(8 * budget)]
    decoders = [[rng.randrange(vocab) for _ in range(4)] for _ in range(2)]
    for chunked in (True, False):
        engine = make(budget, chunked=chunked)
        _, steps = _scenario(engine, long, None, decoders)
        prefilling = [s for s in steps[2:] if s.prefilled_tokens]
        assert all(set(s.progressed) >= {"d0", "d1"} for s in prefilling), seed  # nobody waits a step
        if chunked:
            assert max(s.prefilled_tokens for s in prefilling) <= budget and len(prefilling) == 8, seed
            assert engine.scheduler.stats["chunks"] == 8
        else:
            assert [s.prefilled_tokens for s in prefilling] == [len(long)], seed


def test_a_group_is_chunked_once_and_a_continuation_chunks_after_its_cached_prefix():
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    _, make, vocab = _model("dense", rng)
    budget = rng.randint(8, 16)
    long = [rng.randrange(vocab) for _ in range(budget * rng.randint(3, 9))]
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=rng.randrange(1 << 20))
    engines = [make(budget), make(budget, chunked=False)]
    group = [e.generate([long], params) for e in engines]
    assert group[0].response_token_ids == group[1].response_token_ids, seed
    assert engines[0].scheduler.stats["prefill_tokens"] == len(long), seed  # the prompt once, rows copied
    turn = [rng.randrange(vocab) for _ in range(5)]
    extra = [rng.randrange(vocab) for _ in range(budget * rng.randint(3, 8))]
    outs = []
    for e in engines:
        e.add_request("t1", turn, SamplingParams(temperature=0.0, max_tokens=4), retain=True)
        first = e.run_until_finished(["t1"])["t1"]
        e.add_request("t2", turn + first.token_ids + extra, SamplingParams(temperature=0.0, max_tokens=6),
                      parent="t1")
        outs.append(e.run_until_finished(["t2"])["t2"])
    assert outs[0].cached_tokens == outs[1].cached_tokens == len(turn) + 3, seed
    _same(outs[0], outs[1], f"continuation, seed {seed}")


def test_a_request_aborted_mid_prefill_frees_its_row():
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    _, make, vocab = _model("dense", rng)
    budget = rng.randint(8, 16)
    engine = make(budget)
    decoders = [[rng.randrange(vocab) for _ in range(4)] for _ in range(2)]
    for i, p in enumerate(decoders):
        engine.add_request(f"d{i}", p, SamplingParams(temperature=0.0, max_tokens=30))
    engine.step()
    engine.add_request("long", [rng.randrange(vocab) for _ in range(6 * budget)], SamplingParams(max_tokens=4))
    engine.step()
    engine.step()
    assert engine.scheduler.chunks.current is not None, seed
    out = engine.abort("long")
    assert out.finish_reason == "abort" and out.token_ids == [], seed
    assert engine.scheduler.chunks.current is None and engine.runner.protected_row is None, seed
    late = {f"x{i}": [rng.randrange(vocab) for _ in range(3)] for i in range(2)}  # both fit one budget
    for rid, p in late.items():
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=6))
    engine.step()
    assert engine.scheduler.batch.n == 4, seed  # the last row (the chunked one's) is free again
    got = engine.run_until_finished(list(late))
    alone = make(budget)
    for rid, p in late.items():
        alone.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=6))
        _same(got[rid], alone.run_until_finished([rid])[rid], f"{rid}, seed {seed}")


@pytest.mark.parametrize("kv_on_refit", ["recompute", "keep"])
def test_a_weight_update_mid_chunk_recomputes_or_keeps(kv_on_refit):
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    hf, make, vocab = _model("dense", rng)
    budget = rng.randint(8, 16)
    long = [rng.randrange(vocab) for _ in range(budget * rng.randint(4, 9))]
    p = SamplingParams(temperature=0.0, max_tokens=8)
    engine = make(budget, kv_on_refit=kv_on_refit)
    engine.add_request("long", long, p)
    engine.step()
    engine.step()
    assert engine.scheduler.chunks.current.done == 2 * budget, seed
    new = make_hf_model(hf.config, seed=rng.randrange(1 << 20))
    refit_from_model(engine, new)
    out = engine.run_until_finished(["long"])["long"]
    assert set(out.token_versions) == {engine.weight_version}, seed
    stats = engine.scheduler.stats
    if kv_on_refit == "recompute":  # prefilled again with the new weights: as if started with them
        assert stats["recomputed_requests"] == 1 and stats["prefill_tokens"] == len(long) + 2 * budget, seed
        fresh = make(budget)
        refit_from_model(fresh, new)
        fresh.add_request("long", long, p)
        _same(out, fresh.run_until_finished(["long"])["long"], f"recompute, seed {seed}")
    else:  # continued over the KV the old weights wrote
        assert stats["recomputed_requests"] == 0 and stats["prefill_tokens"] == len(long), seed


def test_the_routing_record_of_a_chunked_moe_request_equals_the_unchunked_one():
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    _, make, vocab = _model("qwen_moe", rng)
    budget = rng.randint(8, 16)
    long = [rng.randrange(vocab) for _ in range(budget * rng.randint(3, 9))]
    decoders = [[rng.randrange(vocab) for _ in range(4)] for _ in range(2)]
    chunked, _ = _scenario(make(budget, record=True), long, None, decoders)
    whole, _ = _scenario(make(budget, chunked=False, record=True), long, None, decoders)
    a, b = chunked["long"].routed_experts, whole["long"].routed_experts
    assert (a[:len(long)] >= 0).all(), seed  # every prompt token recorded
    assert torch.equal(a, b), seed


def test_deepseek_v4_prefills_a_long_prompt_whole():
    """V4's state cannot extend: with chunking asked for, its long prompt still runs in one prefill."""
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    cfg = _deepseek_v4.draw_config(rng)
    engine = RolloutEngine(cfg, EngineSpec(max_batch_size=3, max_seq_len=128), max_prefill_tokens=8)
    engine.load_weights(named_trainer_tensors(_deepseek_v4.hf_model(cfg, seed % 1000)))
    engine.chunked_prefill = True
    assert engine.chunked_prefill is False, seed
    engine.add_request("long", [rng.randrange(_deepseek_v4.VOCAB) for _ in range(40)], SamplingParams(max_tokens=3))
    assert engine.step().prefilled_tokens == 40, seed
    assert len(engine.run_until_finished(["long"])["long"].token_ids) == 3, seed


def test_a_long_prompt_behind_a_spent_budget_starts_its_chunks_next_step():
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    _, make, vocab = _model("dense", rng)
    budget = rng.randint(8, 16)
    engine = make(budget)
    engine.add_request("short", [rng.randrange(vocab) for _ in range(budget)], SamplingParams(max_tokens=20))
    long = [rng.randrange(vocab) for _ in range(3 * budget + 1)]
    engine.add_request("long", long, SamplingParams(max_tokens=2))
    fed = [engine.step().prefilled_tokens for _ in range(5)]
    assert fed == [budget, budget, budget, budget, 1], (seed, fed)
    assert len(engine.run_until_finished(["long"])["long"].token_ids) == 2, seed


def test_a_short_request_waits_when_a_chunk_left_too_little_budget():
    """The long prompt's last chunk (1 token) leaves ``budget - 1``, less than the short
    request queued behind it: that one waits for the next step (the admission once crashed
    here, with nothing to prefill)."""
    seed = _seeds.fresh_seed()
    rng = random.Random(seed)
    _, make, vocab = _model("dense", rng)
    budget = rng.randint(8, 12)
    engine = make(budget)
    engine.add_request("long", [rng.randrange(vocab) for _ in range(2 * budget + 1)], SamplingParams(max_tokens=3))
    engine.add_request("short", [rng.randrange(vocab) for _ in range(budget)], SamplingParams(max_tokens=3))
    fed = [engine.step().prefilled_tokens for _ in range(4)]
    assert fed == [budget, budget, 1, budget], (seed, fed)  # three chunks, then the short prompt whole
    out = engine.run_until_finished(["long", "short"])
    assert [len(out[r].token_ids) for r in ("long", "short")] == [3, 3], seed


def test_no_cuda_graph_pads_into_the_chunked_row():
    """Graph padding rows write KV: while a row is being chunk-prefilled, a batch whose graph
    would pad into it decodes eagerly (checked on the choice; the graphs themselves need CUDA)."""
    rng = random.Random(_seeds.fresh_seed())
    _, make, _ = _model("dense", rng)
    runner = make(8).runner
    runner.graphs = types.SimpleNamespace(batch_sizes=[1, 2, 4])
    assert [runner._graph_spares(b) for b in (1, 2, 3, 4)] == [True] * 4
    runner.protected_row = 3
    assert [runner._graph_spares(b) for b in (1, 2, 3, 4)] == [True, True, False, False]
