"""The request scheduler (continuous batching) against independent references: the same
request alone, transformers' greedy generation, a fresh engine started from the
interruption point, and the same request without its cached prefix."""

import random
import threading
import time

import _seeds
from _greedy import assert_greedy_matches
import pytest
import torch

from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.rollout.core.prefix_cache import PrefixCache, PrefixEntry
from hybridrl.rollout.requests import UnknownRequestError
from hybridrl.rollout.weight_update import WeightUpdateError
from tests.rollout.conftest import VOCAB, make_config, make_hf_model

MAX_SEQ = 64


def _engine(hf, *, max_batch_size=4, **kw) -> RolloutEngine:
    engine = RolloutEngine(hf.config, EngineSpec(max_batch_size=max_batch_size, max_seq_len=MAX_SEQ), **kw)
    engine.load_weights(hf.named_parameters())
    return engine


@pytest.fixture(scope="module")
def hf():
    return make_hf_model(make_config("qwen2"), seed=4)


def _prompt(rng: random.Random, n: int | None = None) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n or rng.randint(3, 12))]


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]], join_after: dict[str, int] | None = None):
    """Add ``requests`` (some only after ``join_after[id]`` steps), step until all finished."""
    join_after = join_after or {}
    for rid, (prompt, p) in requests.items():
        if rid not in join_after:
            engine.add_request(rid, prompt, p)
    outputs, steps = {}, 0
    while len(outputs) < len(requests):
        for rid, k in join_after.items():
            if k == steps:
                engine.add_request(rid, *requests[rid])
        for o in engine.step().finished:
            outputs[o.request_id] = o
        steps += 1
    return outputs


def _same(a, b, tol=1e-5):
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=tol)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_gives_the_same_tokens_alone_or_in_any_mix(hf, temperature):
    rng = random.Random(_seeds.fresh_seed())
    x = (_prompt(rng, 7), SamplingParams(temperature=temperature, max_tokens=20, seed=rng.randrange(1 << 30)))
    others = {f"o{i}": (_prompt(rng), SamplingParams(temperature=1.0, max_tokens=rng.randint(2, 30), seed=i,
                                                     top_k=rng.choice([-1, 5]), stop_token_ids=(rng.randrange(VOCAB),)))
              for i in range(7)}
    engine = _engine(hf, max_batch_size=3)
    alone = _run(engine, {"x": x})["x"]
    mixes = [
        ({"x": x, "o0": others["o0"], "o1": others["o1"]}, {}),  # prefilled together (other lengths)
        ({"x": x, **{k: others[k] for k in ("o2", "o3", "o4")}}, {"x": 3}),  # joins mid-flight
        ({**others, "x": x}, {}),  # waits in the queue until a row frees, then takes a moved row
    ]
    for requests, join in mixes:
        _same(_run(engine, requests, join)["x"], alone)


def test_generate_under_continuous_batching_matches_transformers(hf):
    """More prompts than rows, each with its own length and stop token: every row equals
    transformers' greedy generation of that prompt alone."""
    rng = random.Random(_seeds.fresh_seed())
    prompts = [_prompt(rng) for _ in range(9)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), stop_token_ids=(rng.randrange(VOCAB),))
              for _ in prompts]
    out = _engine(hf, max_batch_size=3).generate(prompts, params)
    for prompt, p, tokens, reason in zip(prompts, params, out.response_token_ids, out.finish_reasons):
        assert_greedy_matches(hf, prompt, tokens)  # transformers' greedy, up to a rounding near-tie
        stops = [i for i, t in enumerate(tokens) if t in p.stop_token_ids]
        assert stops in ([], [len(tokens) - 1]), (tokens, p.stop_token_ids)  # ends at its first stop token
        assert reason == ("stop" if stops else "length") and (stops or len(tokens) == p.max_tokens)
    assert out.weight_version == 1 and out.response_versions() == {1}


def test_a_conversation_continues_from_its_retained_prefix(hf):
    rng = random.Random(_seeds.fresh_seed())
    engine = _engine(hf)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    first = _prompt(rng, 20)
    engine.add_request("t1", first, greedy, retain=True)
    t1 = engine.run_until_finished(["t1"])["t1"]
    history = first + t1.token_ids
    turn = history + _prompt(rng, 8)
    sampled = SamplingParams(temperature=1.0, max_tokens=12, seed=5)
    engine.add_request("t2", turn, sampled, parent="t1", retain=True)
    before = engine.scheduler.stats["prefill_tokens"]
    t2 = engine.run_until_finished(["t2"])["t2"]
    assert t2.cached_tokens == len(history) - 1  # the parent's last token was sampled, never fed
    assert engine.scheduler.stats["prefill_tokens"] - before == len(turn) - t2.cached_tokens
    engine.add_request("t2-fresh", turn, sampled)
    _same(t2, engine.run_until_finished(["t2-fresh"])["t2-fresh"])

    # a next turn that re-tokenized part of the history differently: only the common prefix is reused
    edited = list(turn)
    edited[10] = (edited[10] + 1) % VOCAB
    engine.add_request("t3", edited + t2.token_ids, greedy, parent="t2")
    t3 = engine.run_until_finished(["t3"])["t3"]
    assert t3.cached_tokens == 10
    engine.add_request("t3-fresh", edited + t2.token_ids, greedy)
    _same(t3, engine.run_until_finished(["t3-fresh"])["t3-fresh"])


def test_an_evicted_parent_is_recomputed_and_an_unknown_one_is_an_error(hf):
    rng = random.Random(_seeds.fresh_seed())
    engine = _engine(hf, prefix_cache_bytes=1)  # nothing fits: every retained prefix is evicted at once
    p = SamplingParams(temperature=0.0, max_tokens=6)
    prompt = _prompt(rng, 9)
    engine.add_request("a", prompt, p, retain=True)
    a = engine.run_until_finished(["a"])["a"]
    child = prompt + a.token_ids + _prompt(rng, 4)
    engine.add_request("b", child, p, parent="a")
    b = engine.run_until_finished(["b"])["b"]
    assert b.cached_tokens == 0
    engine.add_request("b-fresh", child, p)
    _same(b, engine.run_until_finished(["b-fresh"])["b-fresh"])
    with pytest.raises(UnknownRequestError, match="unknown parent 'nobody'.*retain=True"):
        engine.add_request("c", child, p, parent="nobody")
    engine.add_request("long", prompt, SamplingParams(max_tokens=30, seed=1))
    with pytest.raises(ValueError, match="parent 'long' has not finished"):
        engine.add_request("d", child, p, parent="long")
    engine.abort("long")
    assert not engine.has_unfinished_requests()


def _perturbed(hf, seed):
    other = make_hf_model(hf.config, seed=seed)
    return other


def test_a_refit_mid_generation_recomputes_and_continues_as_a_fresh_start(hf):
    """Greedy: tokens after the interruption == a fresh engine with the new weights started
    from prompt + the tokens before it; every token records the version that sampled it."""
    rng = random.Random(_seeds.fresh_seed())
    new = _perturbed(hf, seed=9)
    engine = _engine(hf, max_batch_size=3)
    prompts = {f"r{i}": _prompt(rng) for i in range(4)}  # one more than rows: one waits
    p = SamplingParams(temperature=0.0, max_tokens=16)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, p)
    finished = {}
    for _ in range(5):
        finished.update({o.request_id: o for o in engine.step().finished})
    partial = {rid: o.token_ids for rid, o in _peek(engine, prompts).items()}
    with engine.weight_update():
        engine.load_weights(new.named_parameters())
        with pytest.raises(WeightUpdateError, match="weight update is in progress"):
            engine.step()
        engine.add_request("late", prompts["r0"], p)  # queued during the update: runs after it
    assert engine.weight_version == 2
    finished.update(engine.run_until_finished([*prompts, "late"]))
    fresh = _engine(new, max_batch_size=1)
    for rid, prompt in prompts.items():
        before = partial[rid]
        out = finished[rid]
        assert out.token_ids[:len(before)] == before
        ref = fresh.generate([prompt + before], SamplingParams(temperature=0.0, max_tokens=16 - len(before)))
        assert out.token_ids[len(before):] == ref.response_token_ids[0]
        assert out.token_versions == [1] * len(before) + [2] * (len(out.token_ids) - len(before))
    assert finished["late"].token_versions == [2] * len(finished["late"].token_ids)
    assert engine.scheduler.stats["recomputed_requests"] >= 3


def _peek(engine, prompts):
    """Every request's tokens so far (without disturbing it): the scheduler's own records plus
    the running rows' device buffers."""
    batch = engine.scheduler.batch
    out = {}
    rows = list(range(batch.n))
    for s, toks, lps in (batch.take_outputs(rows) if rows else []):
        out[s.request_id] = type("P", (), {"token_ids": s.generated + toks})()
    for s in engine.scheduler.waiting:
        out[s.request_id] = type("P", (), {"token_ids": list(s.generated)})()
    return {rid: out[rid] for rid in prompts if rid in out}


def test_keep_mode_continues_on_the_old_kv_with_new_versions(hf):
    new = _perturbed(hf, seed=10)
    engine = _engine(hf, kv_on_refit="keep")
    rng = random.Random(_seeds.fresh_seed())
    prompt = _prompt(rng, 10)
    engine.add_request("k", prompt, SamplingParams(temperature=0.0, max_tokens=12))
    for _ in range(4):
        engine.step()
    engine.load_weights(new.named_parameters())
    out = engine.run_until_finished(["k"])["k"]
    assert engine.scheduler.stats["recomputed_requests"] == 0
    assert out.token_versions == [1] * 4 + [2] * 8
    reference = _engine(hf, max_batch_size=1).generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    assert out.token_ids[:4] == reference.response_token_ids[0]


def test_bad_requests_are_one_line_errors_and_change_nothing(hf):
    rng = random.Random(_seeds.fresh_seed())
    engine = _engine(hf, max_batch_size=2)
    p = SamplingParams(temperature=0.0, max_tokens=8)
    ok = _prompt(rng, 6)
    engine.add_request("ok", ok, p)
    errors = [
        (lambda: engine.add_request("too-long", [1] * MAX_SEQ, p), ValueError, "'too-long'.*max_seq_len=64"),
        (lambda: engine.add_request("empty", [], p), ValueError, "'empty'.*prompt length 0"),
        (lambda: engine.add_request("bad-id", [VOCAB + 3], p), ValueError, "vocab_size"),
        (lambda: engine.add_request("n2", ok, SamplingParams(n=2)), ValueError, "n=2; a request is one sample"),
        (lambda: engine.add_request("ok", ok, p), ValueError, "already waiting or running"),
    ]
    for call, kind, match in errors:
        with pytest.raises(kind, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    out = engine.run_until_finished(["ok"])["ok"]
    assert engine.abort("ok") is None and engine.abort("never-added") is None  # finished / unknown: no-op
    alone = _engine(hf, max_batch_size=1).generate([ok], p)
    assert out.token_ids == alone.response_token_ids[0]
    assert not engine.has_unfinished_requests() and engine.scheduler.batch.n == 0


def test_abort_returns_the_partial_output_and_frees_the_row(hf):
    rng = random.Random(_seeds.fresh_seed())
    engine = _engine(hf, max_batch_size=2)
    p = SamplingParams(temperature=0.0, max_tokens=20)
    prompts = {k: _prompt(rng) for k in ("a", "b", "c")}
    for k, prompt in prompts.items():
        engine.add_request(k, prompt, p)
    for _ in range(6):
        engine.step()
    cut = engine.abort("a")
    assert cut.finish_reason == "abort" and cut.finished and 0 < len(cut.token_ids) < 20
    rest = engine.run_until_finished(["b", "c"])
    ref = _engine(hf, max_batch_size=3).generate(list(prompts.values()), p)
    assert cut.token_ids == ref.response_token_ids[0][:len(cut.token_ids)]
    assert rest["b"].token_ids == ref.response_token_ids[1] and rest["c"].token_ids == ref.response_token_ids[2]
    waiting = engine.abort("never")  # and a waiting request aborts from the queue
    assert waiting is None
    engine.add_request("w1", prompts["a"], p)
    engine.add_request("w2", prompts["b"], p)
    engine.add_request("w3", prompts["c"], p)
    engine.step()
    queued = engine.abort("w3")
    assert queued.token_ids == [] and queued.finish_reason == "abort"
    engine.run_until_finished(["w1", "w2"])


@pytest.mark.parametrize("chunked", [True, False])
def test_the_prefill_budget_never_starves_decoding(hf, chunked):
    rng = random.Random(_seeds.fresh_seed())
    engine = _engine(hf, max_batch_size=4, max_prefill_tokens=10)
    engine.chunked_prefill = chunked
    p = SamplingParams(temperature=1.0, max_tokens=6, seed=3)
    engine.add_request("first", _prompt(rng, 20), p)  # longer than the budget
    if chunked:  # two chunks of the budget, one per step; the first token after the last
        assert engine.step().prefilled_tokens == 10
        out = engine.step()
        assert out.prefilled_tokens == 10 and ("first" in out.progressed or out.finished)
    else:  # the old rule: admitted alone, prefilled whole
        assert engine.step().prefilled_tokens == 20
    for i in range(3):
        engine.add_request(f"q{i}", _prompt(rng, 6), p)
    for _ in range(3):
        out = engine.step()
        assert out.prefilled_tokens <= 10
        assert "first" in out.progressed or any(o.request_id == "first" for o in out.finished)
    engine.run_until_finished([f"q{i}" for i in range(3)] + ["first"]) if engine.has_unfinished_requests() else None


def test_a_weight_update_waits_for_the_step_in_flight(hf):
    engine = _engine(hf)
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=30))
    engine.step()
    events = []
    decode = engine.runner.decode

    def slow_decode(*a, **k):
        events.append("decode start")
        time.sleep(0.2)
        events.append("decode end")
        return decode(*a, **k)

    engine.runner.decode = slow_decode
    stepper = threading.Thread(target=engine.step)
    stepper.start()
    while not events:
        time.sleep(0.001)
    engine.begin_weight_update()
    events.append("update open")
    engine.abort_weight_update()
    stepper.join()
    assert events == ["decode start", "decode end", "update open"]


def test_prefix_cache_evicts_least_recently_used_within_its_byte_budget():
    def entry(n, version=1):
        k = torch.randn(2, 1, n, 4)
        return PrefixEntry(list(range(n)), (k, k.clone()), None, version)

    one = entry(8).nbytes
    cache = PrefixCache(max_bytes=2 * one)
    cache.put("a", entry(8))
    cache.put("b", entry(8))
    assert cache.get("a", 1) is not None  # a is now the most recently used
    cache.put("c", entry(8))
    assert "b" not in cache and cache.was_evicted("b") and "a" in cache and "c" in cache
    assert cache.bytes == 2 * one
    assert cache.get("a", 2) is None  # retained under other weights: a miss
    cache.put("huge", entry(100))
    assert "huge" not in cache and cache.was_evicted("huge") and cache.bytes == 2 * one


def test_requests_with_more_stop_ids_than_before_join_a_running_batch(hf):
    """The stop-id table widens when a wider request arrives; every row keeps its own stops."""
    rng = random.Random(_seeds.fresh_seed())
    engine = _engine(hf, max_batch_size=3)
    first = _prompt(rng, 6)
    engine.add_request("one-stop", first, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(7,)))
    engine.step()
    stops = tuple(rng.sample(range(VOCAB), 5))
    engine.add_request("five-stops", _prompt(rng, 5), SamplingParams(temperature=0.0, max_tokens=20,
                                                                     stop_token_ids=stops))
    out = engine.run_until_finished(["one-stop", "five-stops"])
    alone = _engine(hf, max_batch_size=1)
    for rid, p in (("one-stop", (7,)), ("five-stops", stops)):
        prompt = out[rid].prompt_token_ids
        ref = alone.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=p))
        assert out[rid].token_ids == ref.response_token_ids[0]
