"""Edges of the built-in engine under exact numerics (``EngineSpec.exact``) that the round
trips of ``test_engine_exact.py`` do not reach, each checked bitwise against the trainer's
packed recomputation (or, where the engine documents an approximation, pinned to it):

- decode steps crossing the attention's 64-key blocks, a ``max_seq_len`` not a multiple of
  64, rows that fill the cache to its last slot, whole and chunked prefill;
- ``n > 1`` groups (one prefill, cache rows copied), identical prompts across requests,
  a chunked group, more running rows than one 32-row GEMM tile;
- stop tokens, ``top_k`` / ``top_p`` truncation, greedy rows, odd temperatures, per-row seeds;
- a weight update while requests run: ``kv_on_refit="recompute"`` gives every token the
  exact log-prob of the version that sampled it (``token_versions``); ``"keep"`` is exact
  for tokens of the old version and for requests prefilled after the update only;
- aborts (running, waiting, mid chunked prefill) and the requests after them;
- retained prefixes evicted under a tiny ``prefix_cache_bytes``: continuations re-prefill;
- ``engine.logits`` with right, left and no padding: the same bits, the trainer's.

Configs are drawn per run (``draw_dense``); the default numerics are shown to differ.
"""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import _seeds
import pytest
import torch

from _engine_round_trip import assert_bitwise, trainer_logprobs
from hybridrl.exact.ops import exact_log_softmax
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.rollout.model_config import parse_hf_config
from hybridrl.rollout.rollouts import rollouts_from_outputs
from test_engine_exact import draw_dense

DTYPES = [torch.float32, torch.bfloat16]


def build(model, exact: bool = True, *, rows: int = 16, seq: int = 64, **engine_kwargs) -> RolloutEngine:
    """An engine holding ``model``'s weights (exact numerics unless ``exact=False``)."""
    spec = EngineSpec(max_batch_size=rows, max_seq_len=seq, dtype=next(model.parameters()).dtype, exact=exact)
    engine = RolloutEngine(model.config, spec, **engine_kwargs)
    engine.load_weights(model.state_dict().items())
    return engine


def mismatched(model, ro, temperature: float, mask: torch.Tensor | None = None) -> int:
    """How many tokens of ``mask`` (default: every response token) carry other log-prob bits
    than the trainer's at ``temperature``."""
    mask = ro.response_mask.bool() if mask is None else mask
    return int((trainer_logprobs(model, ro, temperature)[mask] != ro.logprobs[mask]).sum())


def tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def collect(engine: RolloutEngine, outs: dict, steps: int = 1, until=None) -> None:
    """Step ``steps`` times (or until ``until()``, at most 60 steps), keeping the finished outputs."""
    for _ in range(60 if until else steps):
        if until is not None and until():
            return
        outs.update({o.request_id: o for o in engine.step().finished})
    assert until is None, "the engine never reached the state the test needs"


@pytest.mark.parametrize("dtype,budget", [(d, b) for b in (2048, 20) for d in DTYPES])
def test_decode_across_key_blocks_with_a_ragged_max_seq_len(dtype, budget):
    """Prompts around 64 tokens decode across the first key block's end; ``max_seq_len``
    (77, 100 or 141) cuts the last block short; some rows fill every slot of the cache."""
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, dtype)
    rng = random.Random(seed)
    L = rng.choice([77, 100, 141])
    lens = [rng.randint(50, 66) for _ in range(12)] + [1, 63, 64, 65, L - 2, L - 1]
    lens += [rng.randint(66, L - 1) for _ in range(4)]
    prompts = [tokens(rng, model.config.vocab_size, n) for n in lens]
    params = [SamplingParams(max_tokens=rng.randint(10, 30), seed=rng.randrange(1 << 40)) for _ in prompts]
    engine = build(model, rows=10, seq=L, max_prefill_tokens=budget)
    ro = engine.generate(prompts, params)
    total = ro.attention_mask.sum(1).tolist()
    assert any(p < 64 < t for p, t in zip(ro.prompt_lengths, total)), what  # decode crossed into block 2
    assert max(total) == L, what
    what = f"{what} max_seq_len={L} max_prefill_tokens={budget}"
    assert_bitwise(model, ro, 1.0, what)
    plain = build(model, exact=False, rows=10, seq=L, max_prefill_tokens=budget).generate(prompts, params)
    assert mismatched(model, plain, 1.0) > 0, f"the default numerics matched the trainer: {what}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_groups_and_identical_prompts_share_a_prefill(dtype):
    """``n``-sample groups, a prompt repeated by other requests (other seeds; the same params:
    the same samples), a group whose prompt is chunked; 33-39 rows decode together from the
    first step (more than one 32-row GEMM tile)."""
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, dtype)
    rng = random.Random(seed)
    vocab = model.config.vocab_size

    def sp(n):
        return SamplingParams(n=n, temperature=0.9, max_tokens=rng.randint(4, 16), seed=rng.randrange(1 << 40))
    base = [tokens(rng, vocab, rng.randint(1, 8)) for _ in range(5)]  # all admitted at once (budget 48)
    long = tokens(rng, vocab, rng.randint(50, 70))
    prompts = base + [list(base[0]), list(base[1]), long, list(long)]
    params = [sp(rng.randint(5, 6)) for _ in base]
    params += [sp(3), params[1], sp(4), sp(1)]
    engine = build(model, rows=40, seq=96, max_prefill_tokens=48)
    ro = engine.generate(prompts, params)
    assert_bitwise(model, ro, 0.9, what)
    starts = [sum(p.n for p in params[:i]) for i in range(len(params))]
    n1, dup = params[1].n, starts[6]
    assert ro.response_token_ids[starts[1]:starts[1] + n1] == ro.response_token_ids[dup:dup + n1], what
    assert torch.equal(ro.logprobs[starts[1]:starts[1] + n1], ro.logprobs[dup:dup + n1]), what
    for i, p in enumerate(params[:5]):  # each sample of a group has its own seed
        group = ro.response_token_ids[starts[i]:starts[i] + p.n]
        assert len({tuple(r) for r in group}) > 1, f"group {i} sampled {p.n} identical responses: {what}"
    fed = sum(len(pr) * p.n for pr, p in zip(prompts, params))
    assert engine.scheduler.stats["prefill_tokens"] < fed, what  # identical prompts were prefilled once


@pytest.mark.parametrize("dtype", DTYPES)
def test_stop_tokens_truncation_greedy_rows_and_seeds(dtype):
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, dtype)
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    stops, temps = tuple(rng.sample(range(1, vocab), 8)), (0.0, 0.35, 0.8, 1.0, 1.3)
    params = [SamplingParams(temperature=temps[i % 5], top_k=rng.choice([-1, 1, 3, 12]),
                             top_p=rng.choice([1.0, .3, .75]), max_tokens=rng.randint(6, 24),
                             stop_token_ids=stops if i % 3 else (), seed=rng.randrange(1 << 62)) for i in range(40)]
    prompts = [tokens(rng, vocab, rng.randint(1, 24)) for _ in params]
    engine = build(model, rows=12)
    ro = engine.generate(prompts, params)
    resp = ro.response_mask.bool()
    for t in temps:  # a greedy row reports log_softmax(logits): the trainer scores it at 1
        rows = torch.tensor([p.temperature == t for p in params])
        n = mismatched(model, ro, t or 1.0, resp & rows[:, None])
        assert n == 0, f"temperature {t}: {n} tokens differ: {what}"
    for r, p, why in zip(ro.response_token_ids, params, ro.finish_reasons):
        assert [j for j, x in enumerate(r) if x in p.stop_token_ids] == ([len(r) - 1] if why == "stop" else []), what
    assert {"stop", "length"} <= set(ro.finish_reasons), what
    logits = engine.logits(ro.input_ids, ro.attention_mask)  # the decode steps' bits (test_logits_... below)
    for i, p in enumerate(params):
        P, r = ro.prompt_lengths[i], torch.tensor(ro.response_token_ids[i])
        z = logits[i, P - 1:P - 1 + len(r)]
        if p.temperature == 0:
            assert torch.equal(r, z.argmax(-1)), f"greedy row {i} is not the argmax: {what}"
            continue
        if p.top_k == 1:  # a top logit (bf16 logits tie: top_k=1 may pick another of them than argmax)
            assert torch.equal(z.gather(1, r[:, None])[:, 0], z.amax(-1)), f"row {i} ({p}): {what}"
            continue
        probs = exact_log_softmax(z / p.temperature).exp()
        above = probs > probs.gather(1, r[:, None])
        if p.top_k > 0:
            assert (above.sum(-1) < p.top_k).all(), f"row {i} ({p}) sampled past top_k: {what}"
        kept = probs.sort(-1, descending=True).values[:, :p.top_k if p.top_k > 0 else vocab].sum(-1)
        mass = (probs * above).sum(-1)
        assert (mass <= p.top_p * kept * (1 + 1e-5)).all(), f"row {i} ({p}) sampled past top_p: {what}"
    for i in rng.sample(range(40), 4):  # a row's tokens are its seed's, whatever shares its steps
        alone = engine.generate([prompts[i]], [params[i]])
        assert alone.response_token_ids[0] == ro.response_token_ids[i], f"row {i}: {what}"
        assert alone.response_logprobs[0] == ro.response_logprobs[i], f"row {i}: {what}"


def perturbed(model, seed: int):
    """``model`` after a training step's worth of change: every weight moved a little."""
    other, g = copy.deepcopy(model), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
    return other


@pytest.mark.parametrize("dtype,mode", [(torch.float32, "recompute"), (torch.bfloat16, "recompute"),
                                        (torch.float32, "keep"), (torch.bfloat16, "keep")])
def test_weight_update_while_requests_run(dtype, mode):
    """A refit lands while rows decode, wait and prefill in chunks (two more requests are
    queued during it). Every token records the version that sampled it. ``recompute``: each
    token is bitwise its version's log-prob of the whole sequence (the later tokens: the new
    weights' scoring of the old tokens + the new; the earlier ones are *not* the new weights').
    ``keep`` (documented approximate): exact for the old version's tokens and the requests
    prefilled after the update; the new tokens of rows that kept old KV differ."""
    seed = _seeds.fresh_seed()
    old_model, what = draw_dense(seed, dtype)
    new_model = perturbed(old_model, seed)
    rng = random.Random(seed)
    vocab, T, ids = old_model.config.vocab_size, 0.9, [f"r{i}" for i in range(12)]

    def add(i):
        n = rng.randint(30, 40) if i in (4, 7) else rng.randint(2, 14)
        engine.add_request(ids[i], tokens(rng, vocab, n), SamplingParams(temperature=T, max_tokens=rng.randint(8, 24),
                                                                         seed=rng.randrange(1 << 40)))
    engine = build(old_model, rows=6, seq=96, max_prefill_tokens=16, kv_on_refit=mode)
    for i in range(10):
        add(i)
    outs = {}
    sched = engine.scheduler
    collect(engine, outs, until=lambda: sched.batch.n >= 3 and sched.waiting and sched.chunks.current is not None)
    engine.begin_weight_update()
    for i in (10, 11):  # queued while the update is open
        add(i)
    engine.load_weights(new_model.state_dict().items())
    assert engine.finish_weight_update() == 2
    outs.update(engine.run_until_finished([r for r in ids if r not in outs]))
    ro = rollouts_from_outputs([outs[r] for r in ids])
    v1, v2 = ro.token_versions == 1, ro.token_versions == 2
    mixed = (v1.any(1) & v2.any(1))[:, None]
    assert mixed.any() and ro.weight_version == 1 and ro.response_versions() == {1, 2}, what
    assert mismatched(old_model, ro, T, v1) == 0, f"{mode}: the old weights' tokens differ: {what}"
    if mode == "recompute":
        assert engine.scheduler.stats["recomputed_requests"] > 0
        n = mismatched(new_model, ro, T, v2)
        assert n == 0, f"{n} of {int(v2.sum())} tokens after the update are not the new weights': {what}"
        assert mismatched(new_model, ro, T, v1) > 0, what  # the old tokens stay the old policy's
    else:
        late = torch.zeros_like(v2)
        late[10:] = True
        assert mismatched(new_model, ro, T, v2 & late) == 0, f"keep: a fresh prefill after the update: {what}"
        assert mismatched(new_model, ro, T, v2 & mixed) > 0, f"keep: the kept KV changed nothing: {what}"


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_a_prefix_retained_before_an_update(mode):
    """Turn 1 retained under the old weights, turn 2 after an update: ``recompute`` drops the
    stale prefix and prefills the conversation again (bitwise the new weights'); ``keep``
    extends the old KV (documented approximate: not the new weights' bits)."""
    seed = _seeds.fresh_seed()
    old_model, what = draw_dense(seed, torch.float32)
    new_model, rng = perturbed(old_model, seed), random.Random(seed)
    vocab, n = old_model.config.vocab_size, 5
    engine = build(old_model, rows=8, seq=96, kv_on_refit=mode)
    for i in range(n):
        engine.add_request(f"p{i}", tokens(rng, vocab, rng.randint(4, 20)), SamplingParams(max_tokens=8, seed=i),
                           retain=True)
    turn1 = engine.run_until_finished([f"p{i}" for i in range(n)])
    engine.load_weights(new_model.state_dict().items())
    for i in range(n):
        o = turn1[f"p{i}"]
        engine.add_request(f"c{i}", o.prompt_token_ids + o.token_ids + tokens(rng, vocab, 3),
                           SamplingParams(max_tokens=8, seed=10 + i), parent=f"p{i}")
    turn2 = engine.run_until_finished([f"c{i}" for i in range(n)])
    ro = rollouts_from_outputs([turn2[f"c{i}"] for i in range(n)])
    assert ro.response_versions() == {2}, what
    reused = [turn2[f"c{i}"].cached_tokens for i in range(n)]
    if mode == "recompute":
        assert reused == [0] * n, what
        assert_bitwise(new_model, ro, 1.0, what, min_tokens=40)
    else:
        assert all(reused), what
        assert mismatched(new_model, ro, 1.0) > 0, f"keep: the stale prefix changed nothing: {what}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_aborts_leave_the_engine_exact(dtype):
    """Abort two decoding rows, a waiting request and the one being prefilled in chunks; the
    rest finish, their partial outputs and a second wave are bitwise (the second wave also
    equals a fresh engine's samples)."""
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, dtype)
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts = [tokens(rng, vocab, rng.randint(30, 60) if i % 4 == 3 else rng.randint(2, 14)) for i in range(16)]
    params = [SamplingParams(max_tokens=rng.randint(6, 24), seed=rng.randrange(1 << 40)) for _ in prompts]
    ids = [f"a{i}" for i in range(16)]
    engine, outs = build(model, rows=6, seq=96, max_prefill_tokens=16), {}
    for r, p, sp in zip(ids, prompts, params):
        engine.add_request(r, p, sp)
    sched = engine.scheduler
    collect(engine, outs, until=lambda: sched.chunks.current is not None and sched.batch.n >= 2 and sched.waiting)
    victims = [s.request_id for s in sched.batch.seqs[:2]] + [sched.waiting[-1].request_id,
                                                              sched.chunks.seqs[0].request_id]
    aborted = [engine.abort(r) for r in victims]
    assert [a.finish_reason for a in aborted] == ["abort"] * 4 and engine.abort(victims[0]) is None, what
    assert not aborted[2].token_ids and not aborted[3].token_ids, what
    outs.update(engine.run_until_finished([r for r in ids if r not in outs and r not in victims]))
    first = [outs[r] for r in ids if r not in victims] + [a for a in aborted if a.token_ids]
    assert_bitwise(model, rollouts_from_outputs(first), 1.0, f"{what}: around aborts")
    wave = [tokens(rng, vocab, rng.randint(2, 40)) for _ in range(12)]
    wave_params = [SamplingParams(max_tokens=rng.randint(4, 20), seed=rng.randrange(1 << 40)) for _ in wave]
    ro = engine.generate(wave, wave_params)
    assert_bitwise(model, ro, 1.0, f"{what}: after aborts", min_tokens=40)
    fresh = build(model, rows=6, seq=96, max_prefill_tokens=16).generate(wave, wave_params)
    assert fresh.response_token_ids == ro.response_token_ids and torch.equal(fresh.logprobs, ro.logprobs), what


@pytest.mark.parametrize("dtype,budget", [(torch.float32, 2048), (torch.bfloat16, 8)])
def test_evicted_parents_are_prefilled_again(dtype, budget):
    """A prefix cache holding ~40 tokens of KV: turn 1's retained prefixes evict each other
    (one is larger than the whole budget); turn 2 extends the survivors' cached KV (one from a
    shorter common prefix: a re-tokenized turn) and re-prefills the evicted ones, bitwise alike."""
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, dtype)
    rng = random.Random(seed)
    vocab, cfg = model.config.vocab_size, parse_hf_config(model.config)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
    engine = build(model, rows=8, seq=128, max_prefill_tokens=budget, prefix_cache_bytes=40 * per_token)
    assert engine.runner.kv_cache.bytes_per_token == per_token
    firsts = [f"t1-{i}" for i in range(7)]
    for i, rid in enumerate(firsts):
        n = 45 if i == 3 else rng.randint(6, 24)
        engine.add_request(rid, tokens(rng, vocab, n), SamplingParams(max_tokens=rng.randint(3, 10), seed=i),
                           retain=True)
    turn1 = engine.run_until_finished(firsts)
    prefixes = engine.scheduler.prefixes
    kept = [r for r in firsts if r in prefixes]
    assert prefixes.evictions > 0 and kept and "t1-3" not in kept and prefixes.bytes <= 40 * per_token, what
    seconds, cuts = [f"t2-{i}" for i in range(7)], {}
    for i, (rid, nid) in enumerate(zip(firsts, seconds)):
        conv = turn1[rid].prompt_token_ids + turn1[rid].token_ids
        if rid == kept[-1] and len(conv) > 4:
            cuts[nid] = rng.randint(2, len(conv) - 2)  # diverges from the retained tokens here
            conv = conv[:cuts[nid]]
        engine.add_request(nid, conv + tokens(rng, vocab, rng.randint(1, 12)),
                           SamplingParams(max_tokens=rng.randint(3, 12), seed=100 + i), parent=rid)
    turn2 = engine.run_until_finished(seconds)
    for rid, nid in zip(firsts, seconds):
        want = min(cuts.get(nid, 1 << 30), len(turn1[rid].prompt_token_ids) + len(turn1[rid].token_ids) - 1)
        assert turn2[nid].cached_tokens == (want if rid in kept else 0), f"{nid}: {what}"
    assert_bitwise(model, rollouts_from_outputs([turn2[r] for r in seconds]), 1.0, what, min_tokens=20)
    assert_bitwise(model, rollouts_from_outputs([turn1[r] for r in firsts]), 1.0, what, min_tokens=20)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_are_the_same_bits_right_left_or_unpadded(dtype):
    """``engine.logits`` of a row: the same bits right-padded, left-padded, with pads between
    its tokens, or alone; and the trainer's log-prob of every token after the first (rows of
    1..max_seq_len tokens, the 64-key block's edges among them)."""
    seed = _seeds.fresh_seed()
    model, what = draw_dense(seed, dtype)
    rng = random.Random(seed)
    L = 100
    lens = [1, 2, 63, 64, 65, L] + [rng.randint(3, L) for _ in range(6)]
    rng.shuffle(lens)
    rows = [tokens(rng, model.config.vocab_size, n) for n in lens]
    B, S = len(rows), max(lens)
    right, left = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long)
    right_mask, left_mask = torch.zeros_like(right), torch.zeros_like(left)
    holes, holes_mask, spots = torch.zeros(B, L, dtype=torch.long), torch.zeros(B, L, dtype=torch.long), []
    for b, r in enumerate(rows):
        right[b, :len(r)], left[b, S - len(r):] = torch.tensor(r), torch.tensor(r)
        right_mask[b, :len(r)] = left_mask[b, S - len(r):] = 1
        spots.append(torch.tensor(sorted(rng.sample(range(L), len(r)))))
        holes[b, spots[-1]], holes_mask[b, spots[-1]] = torch.tensor(r), 1
    engine = build(model, rows=4, seq=L)
    by_right, by_left = engine.logits(right, right_mask), engine.logits(left, left_mask)
    by_holes = engine.logits(holes, holes_mask)
    for b, r in enumerate(rows):
        alone = engine.logits(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))[0]
        assert torch.equal(by_right[b, :len(r)], alone) and torch.equal(by_left[b, S - len(r):], alone), \
            f"row {b} ({len(r)} tokens): {what}"
        assert torch.equal(by_holes[b, spots[b]], alone), f"row {b} ({len(r)} tokens) with pads between: {what}"
    scored = right_mask.clone().float()
    scored[:, 0] = 0
    ro = SimpleNamespace(input_ids=right, attention_mask=right_mask, response_mask=scored)
    got = torch.zeros(B, S)
    got[:, 1:] = exact_log_softmax(by_right)[:, :-1].gather(-1, right[:, 1:, None]).squeeze(-1)
    mask = scored.bool()
    assert torch.equal(trainer_logprobs(model, ro, 1.0)[mask], got[mask]), what
    plain = build(model, exact=False, rows=4, seq=L).logits(right, right_mask)
    got[:, 1:] = torch.log_softmax(plain, -1)[:, :-1].gather(-1, right[:, 1:, None]).squeeze(-1)
    assert not torch.equal(trainer_logprobs(model, ro, 1.0)[mask], got[mask]), f"default numerics matched: {what}"
