"""VllmEngine's request API (add_request / step / abort, request_api.py) on vLLM's own
scheduler, against independent references: ``generate`` of the same prompts and seeds, a
fresh greedy generation with the new weights after a refit mid-request, the same request
without its parent. Real vLLM (CPU), no mocks; random inputs from fixed seeds."""

from __future__ import annotations

import random

import pytest
from _vllm_helpers import MAX_SEQ, SKIP_NO_VLLM, encode, perturbed

from hybridrl.refit import refit_from_model
from hybridrl.rollout import EngineSpec, SamplingParams
from hybridrl.rollout.requests import UnknownRequestError
from hybridrl.rollout.weight_update import WeightUpdateError

pytestmark = SKIP_NO_VLLM
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
MAX_STEPS = 200  # far more than any test needs: a loop that does not end is a failure, not a hang


def run_all(engine) -> dict:
    """Step until no request is unfinished; every finished output by id."""
    done = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return done
        for r in engine.step().finished:
            assert r.request_id not in done
            done[r.request_id] = r
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


def assert_same(out, tokens, logprobs, tol=1e-5):
    assert out.token_ids == tokens, (out.request_id, out.token_ids, tokens)
    assert len(out.logprobs) == len(logprobs)
    assert max((abs(a - b) for a, b in zip(out.logprobs, logprobs)), default=0.0) < tol, out.request_id


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg, msg
    return msg


@pytest.fixture
def weights(engine, tiny_checkpoint):
    """(checkpoint model, a perturbed copy the engine now holds); the checkpoint's weights
    are back on the engine after the test (the engine is shared by the module)."""
    _, tok, model = tiny_checkpoint
    w1 = perturbed(model, seed=21)
    refit_from_model(engine, w1)
    yield model, w1
    assert not engine.has_unfinished_requests()
    refit_from_model(engine, model)


def test_step_loop_equals_generate(engine, tiny_checkpoint, weights):
    _, tok, _ = tiny_checkpoint
    prompts = encode(tok)
    rng = random.Random(0)
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, max_tokens=rng.randint(4, 14), seed=rng.randrange(2**31),
                                 stop_token_ids=(tok.eos_token_id,)) for _ in prompts]
        ref = engine.generate(prompts, params)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", p, sp)
        assert engine.has_unfinished_requests()
        done = run_all(engine)
        assert sorted(done) == [f"r{i}" for i in range(len(prompts))]
        for i, p in enumerate(prompts):
            out = done[f"r{i}"]
            assert out.finished and out.prompt_token_ids == p and out.routed_experts is None
            assert_same(out, ref.response_token_ids[i], ref.response_logprobs[i])
            assert out.finish_reason == ref.finish_reasons[i]
            assert out.token_versions == [engine.weight_version] * len(out.token_ids)


def test_abort_returns_partial_output(engine, tiny_checkpoint, weights):
    _, tok, _ = tiny_checkpoint
    prompts = encode(tok)[:3]
    ref = engine.generate(prompts, GREEDY)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, GREEDY)
    for _ in range(3):
        out = engine.step()
        assert not out.finished
    assert sorted(out.progressed) == ["a0", "a1", "a2"]
    part = engine.abort("a1")
    assert part.finish_reason == "abort" and part.finished and len(part.token_ids) == 3
    assert_same(part, ref.response_token_ids[1][:3], ref.response_logprobs[1][:3])
    assert engine.abort("a1") is None and engine.abort("never-added") is None
    done = run_all(engine)
    assert sorted(done) == ["a0", "a2"]
    for i in (0, 2):
        assert done[f"a{i}"].finish_reason == "length"
        assert_same(done[f"a{i}"], ref.response_token_ids[i], ref.response_logprobs[i])
    assert engine.abort("a0") is None  # finished: a no-op
    again = engine.generate(prompts, GREEDY)  # nothing changed
    assert again.response_token_ids == ref.response_token_ids


def _refit_mid_generation(engine, prompts, old, new, steps: int = 4):
    """Greedy requests, ``steps`` steps with ``old``, a refit to ``new``, run to the end:
    (outputs in prompt order, old version, new version)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"m{i}", p, GREEDY)
    for _ in range(steps):
        assert not engine.step().finished
    v_old = engine.weight_version
    refit_from_model(engine, new)
    assert engine.has_unfinished_requests()
    done = run_all(engine)
    return [done[f"m{i}"] for i in range(len(prompts))], v_old, engine.weight_version


def test_refit_mid_generation_recomputes_with_the_new_weights(engine, tiny_checkpoint, weights):
    """Tokens after the refit = a fresh greedy generation with the new weights from prompt +
    the tokens generated before it; versions old for those k tokens, new after."""
    _, tok, _ = tiny_checkpoint
    _, w1 = weights
    assert engine.kv_on_refit == "recompute"
    prompts = encode(tok)
    before = engine.generate(prompts, GREEDY)  # w1's greedy answers
    w2 = perturbed(w1, seed=22)
    outs, v1, v2 = _refit_mid_generation(engine, prompts, w1, w2, steps=4)
    assert v2 == v1 + 1
    k = 4
    cont = engine.generate([p + o.token_ids[:k] for p, o in zip(prompts, outs)],
                           SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens - k))
    changed = 0
    for i, o in enumerate(outs):
        assert o.finish_reason == "length" and len(o.token_ids) == GREEDY.max_tokens
        assert o.token_versions == [v1] * k + [v2] * (GREEDY.max_tokens - k)
        assert_same(o, before.response_token_ids[i][:k] + cont.response_token_ids[i],
                    before.response_logprobs[i][:k] + cont.response_logprobs[i])
        changed += o.token_ids != before.response_token_ids[i]
    assert changed > 0, "the new weights changed no answer: the test would not see stale KV"


def test_keep_continues_on_the_old_kv(engine, tiny_checkpoint, weights, monkeypatch):
    """kv_on_refit="keep": the requests continue in vLLM, only the version changes; refit to
    the same weights, the answers are the uninterrupted ones exactly. (The shared engine is
    switched to "keep": a second in-process vLLM engine, once closed, tears down the
    torch.distributed groups the first one still uses.)"""
    from hybridrl.vllm_backend import VllmEngine

    ckpt, tok, _ = tiny_checkpoint
    _, w1 = weights
    with pytest.raises(ValueError, match="kv_on_refit='sometimes'") as e:  # before vLLM is built
        VllmEngine(ckpt, EngineSpec(max_batch_size=2, max_seq_len=8), kv_on_refit="sometimes")
    one_line(e)
    monkeypatch.setattr(engine.requests, "kv_on_refit", "keep")
    assert engine.kv_on_refit == "keep"
    prompts = encode(tok)
    ref = engine.generate(prompts, GREEDY)
    outs, v1, v2 = _refit_mid_generation(engine, prompts, w1, w1, steps=3)
    for i, o in enumerate(outs):
        assert o.token_versions == [v1] * 3 + [v2] * (GREEDY.max_tokens - 3)
        assert_same(o, ref.response_token_ids[i], ref.response_logprobs[i])
    outs, v2, v3 = _refit_mid_generation(engine, prompts, w1, perturbed(w1, seed=23), steps=5)
    for i, o in enumerate(outs):
        assert o.token_ids[:5] == ref.response_token_ids[i][:5] and len(o.token_ids) == GREEDY.max_tokens
        assert o.token_versions == [v2] * 5 + [v3] * (GREEDY.max_tokens - 5)


def test_bad_input_and_held_requests(engine, tiny_checkpoint, weights, monkeypatch):
    _, tok, model = tiny_checkpoint
    _, w1 = weights
    prompts = encode(tok)
    ref = engine.generate(prompts[:2], GREEDY)
    with pytest.raises(ValueError, match="'long'.*prompt length") as e:
        engine.add_request("long", [1] * MAX_SEQ, GREEDY)
    one_line(e)
    with pytest.raises(ValueError, match="n=2") as e:
        engine.add_request("two", prompts[0], SamplingParams(n=2))
    one_line(e)
    with pytest.raises(UnknownRequestError, match="retain=True") as e:
        engine.add_request("child", prompts[0], GREEDY, parent="nobody")
    one_line(e)
    engine.add_request("p", prompts[0], GREEDY, retain=True)
    with pytest.raises(ValueError, match="already waiting or running") as e:
        engine.add_request("p", prompts[1], GREEDY)
    one_line(e)
    with pytest.raises(ValueError, match="has not finished yet") as e:
        engine.add_request("child", prompts[0], GREEDY, parent="p")
    one_line(e)
    engine.step()

    # an open update: step refuses, new requests wait outside vLLM, abort closes it unchanged
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="weight update is in progress") as e:
        engine.step()
    one_line(e)
    engine.add_request("held", prompts[1], GREEDY)
    engine.add_request("held-aborted", prompts[1], GREEDY)
    gone = engine.abort("held-aborted")
    assert gone.finish_reason == "abort" and gone.token_ids == []
    engine.abort_weight_update()
    done = run_all(engine)
    assert sorted(done) == ["held", "p"]
    assert_same(done["p"], ref.response_token_ids[0], ref.response_logprobs[0])
    assert_same(done["held"], ref.response_token_ids[1], ref.response_logprobs[1])

    # a request added during a committed update runs after it, all of it with the new weights
    v = engine.weight_version
    with engine.weight_update():
        engine.add_request("during", prompts[1], GREEDY)
        engine.load_weights(w1.state_dict().items())
    out = run_all(engine)["during"]
    assert out.token_versions == [v + 1] * GREEDY.max_tokens
    assert_same(out, ref.response_token_ids[1], ref.response_logprobs[1])

    # broken weights (a reload that swaps k and v, caught by the reload check): requests in
    # flight wait, step refuses like generate; the next good refit recomputes them
    engine.add_request("survivor", prompts[0], GREEDY)
    engine.step()
    real_rpc = engine.llm.collective_rpc

    def swapping_rpc(method, *args, kwargs=None, **kw):
        if method == "reload_weights":
            pairs = dict(kwargs["weights_iterator"])
            k, v_ = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
            pairs[k], pairs[v_] = pairs[v_], pairs[k]
            kwargs = {**kwargs, "weights_iterator": list(pairs.items())}
        return real_rpc(method, *args, kwargs=kwargs, **kw)

    monkeypatch.setattr(engine.llm, "collective_rpc", swapping_rpc)
    with pytest.raises(WeightUpdateError):
        refit_from_model(engine, perturbed(model, seed=5))
    monkeypatch.undo()
    with pytest.raises(WeightUpdateError, match="failed") as e:
        engine.step()
    assert one_line(e).startswith("step: ")
    refit_from_model(engine, w1)
    out = run_all(engine)["survivor"]
    assert_same(out, ref.response_token_ids[0], ref.response_logprobs[0])
    assert out.token_versions == [engine.weight_version - 1] + [engine.weight_version] * (GREEDY.max_tokens - 1)

    # generate refuses while requests run (vLLM would run them too); the engine still serves
    engine.add_request("busy", prompts[0], GREEDY)
    with pytest.raises(RuntimeError, match="in flight") as e:
        engine.generate(prompts[:1], GREEDY)
    one_line(e)
    assert engine.abort("busy").finish_reason == "abort"
    assert engine.generate(prompts[:2], GREEDY).response_token_ids == ref.response_token_ids


def test_continuation_with_parent_equals_one_without(engine, tiny_checkpoint, weights):
    _, tok, _ = tiny_checkpoint
    prompts = encode(tok)[:3]
    first = SamplingParams(temperature=0.0, max_tokens=6)
    for i, p in enumerate(prompts):
        engine.add_request(f"t1-{i}", p, first, retain=True)
    turn1 = run_all(engine)
    rng = random.Random(1)
    nxt = SamplingParams(temperature=1.0, max_tokens=8, seed=rng.randrange(2**31))
    for i, p in enumerate(prompts):
        ctx = p + turn1[f"t1-{i}"].token_ids + encode(tok, ["?"])[0]
        engine.add_request(f"t2-{i}", ctx, nxt, parent=f"t1-{i}")
        engine.add_request(f"solo-{i}", ctx, nxt)
    done = run_all(engine)
    for i in range(len(prompts)):
        solo = done[f"solo-{i}"]
        assert_same(done[f"t2-{i}"], solo.token_ids, solo.logprobs)
    assert engine.release("t1-0") is True and engine.release("t1-0") is False
    with pytest.raises(UnknownRequestError, match="retain=True"):
        engine.add_request("t2-again", prompts[0] + [1], nxt, parent="t1-0")
