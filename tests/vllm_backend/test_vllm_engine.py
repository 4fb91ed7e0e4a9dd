"""VllmEngine (vLLM in-process on CPU) behind the RolloutEngine interface: refit through
`refit_from_model` unchanged, greedy = transformers = built-in engine, sampling log-probs =
the trainer's recompute (also with top-k / top-p), versions, rejected updates, a failed
reload that is caught, the sleep / wake-up order around a refit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _vllm_helpers import MAX_SEQ, SKIP_NO_VLLM, assert_greedy_matches, encode, perturbed, record_llm_calls

from hybridrl.refit import RefitError, refit_from_model
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.weight_update import WeightUpdateError

pytestmark = SKIP_NO_VLLM


def _greedy(engine, prompts, max_tokens=10):
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens)).response_token_ids


def test_from_pretrained_is_version_1_and_matches_transformers(engine, tiny_checkpoint):
    _, tok, model = tiny_checkpoint
    refit_from_model(engine, model)  # back to the checkpoint's weights whatever ran before
    prompts = encode(tok)
    for p, toks in zip(prompts, _greedy(engine, prompts)):
        assert_greedy_matches(model, p, toks)


def test_refit_from_perturbed_model(engine, tiny_checkpoint):
    """The issue's core check: refit via refit_from_model, then greedy == transformers,
    sampled log-probs == the trainer's recompute (1e-4), weight_version advanced once."""
    from hybridrl.trainer.forward import ForwardOptions, compute_logprobs_entropy

    _, tok, model = tiny_checkpoint
    new = perturbed(model, seed=1)
    v0 = engine.weight_version
    stats = refit_from_model(engine, new)
    assert engine.weight_version == stats.version == v0 + 1
    prompts = encode(tok)
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    assert greedy.weight_version == v0 + 1
    for p, toks in zip(prompts, greedy.response_token_ids):
        assert_greedy_matches(new, p, toks)

    for temperature in (1.0, 0.7):
        ro = engine.generate(prompts, SamplingParams(temperature=temperature, max_tokens=12, n=4, seed=7,
                                                     stop_token_ids=(tok.eos_token_id,)))
        assert len(ro.response_token_ids) == 4 * len(prompts)
        with torch.no_grad():
            lp, _ = compute_logprobs_entropy(new, ro.input_ids, ro.attention_mask, ro.response_mask,
                                             options=ForwardOptions(temperature=temperature))
        mask = ro.response_mask.bool()
        assert mask.sum() > 0
        assert (lp - ro.logprobs)[mask].abs().max() < 1e-4, temperature
        assert (ro.logprobs[~mask] == 0).all()
    assert engine.weight_version == v0 + 1  # generating does not touch the version


def test_greedy_equals_builtin_engine(engine, tiny_checkpoint):
    from hybridrl.rollout import EngineSpec, RolloutEngine

    _, tok, model = tiny_checkpoint
    new = perturbed(model, seed=2)
    builtin = RolloutEngine(new.config, EngineSpec(max_batch_size=8, max_seq_len=MAX_SEQ))
    refit_from_model(builtin, new)
    refit_from_model(engine, new)
    prompts = encode(tok)
    ours, theirs = _greedy(builtin, prompts), _greedy(engine, prompts)
    for p, a, b in zip(prompts, ours, theirs):
        if a != b:  # only a kernel-rounding near-tie may split them: both must be transformers' greedy
            assert_greedy_matches(new, p, a)
            assert_greedy_matches(new, p, b)
    assert sum(a == b for a, b in zip(ours, theirs)) >= len(prompts) - 1


def test_verified_refit_reads_back_exactly(engine, tiny_checkpoint):
    """verify=True: refit's own verifier (addresses + exact checksums of what vLLM holds,
    read back through its packed GEMMs) passes; every route holds exactly what was sent."""
    _, _, model = tiny_checkpoint
    new = perturbed(model, seed=3)
    v0 = engine.weight_version
    refit_from_model(engine, new, verify=True)
    assert engine.weight_version == v0 + 1
    sent = dict(new.named_parameters())
    for route in engine.weight_routes:
        assert torch.equal(route.held(), route.expected_held(sent[route.hf_name])), route.hf_name


def test_missing_name_is_rejected_with_the_engine_unchanged(engine, tiny_checkpoint):
    _, tok, model = tiny_checkpoint
    refit_from_model(engine, model)
    prompts = encode(tok)
    before, v0 = _greedy(engine, prompts), engine.weight_version
    other = perturbed(model, seed=4)
    pairs = [(n, p.detach()) for n, p in other.named_parameters() if n != "model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(RefitError, match="up_proj"):
        refit_from_model(engine, pairs)
    assert engine.weight_version == v0 and not engine.weight_update_in_progress
    assert _greedy(engine, prompts) == before

    # The bracket itself, fed short of a name: finish raises, nothing reached vLLM.
    engine.begin_weight_update()
    engine.load_weights(pairs)
    with pytest.raises(WeightUpdateError, match="never loaded"):
        engine.finish_weight_update()
    assert engine.weight_version == v0 and _greedy(engine, prompts) == before


def test_bad_bucket_is_rejected_before_anything_is_staged(engine, tiny_checkpoint):
    _, _, model = tiny_checkpoint
    refit_from_model(engine, model)
    v0 = engine.weight_version
    good = [(n, p.detach()) for n, p in model.named_parameters()]
    wrong_shape = [(n, t if "norm" not in n else t[:-1]) for n, t in good]
    for bucket, what in ((good + [("model.layers.9.mlp.up_proj.weight", good[0][1])], "unknown"),
                         (wrong_shape, "shape"), (good + good[:1], "duplicate")):
        with pytest.raises(WeightUpdateError, match=what):
            engine.load_weights(bucket)  # one-shot: aborted, nothing staged
        assert engine.weight_version == v0 and not engine.weight_update_in_progress
    with engine.weight_update():
        engine.load_weights(good[:3])
        with pytest.raises(WeightUpdateError, match="duplicate"):
            engine.load_weights(good[:1])
        engine.load_weights(good[3:])
    assert engine.weight_version == v0 + 1


def test_a_refit_records_the_version_it_is_handed(engine, tiny_checkpoint):
    _, tok, model = tiny_checkpoint
    v0 = engine.weight_version
    stats = refit_from_model(engine, model, version=v0 + 9)
    assert stats.version == engine.weight_version == v0 + 9
    assert engine.generate(encode(tok)[:1], SamplingParams(max_tokens=2)).weight_version == v0 + 9
    with pytest.raises(ValueError, match="version=0 must be an int >= 1"):
        with engine.weight_update(version=0):
            engine.load_weights(model.named_parameters())
    assert engine.weight_version == v0 + 9 and not engine.weight_update_in_progress


def test_bracket_order_is_enforced(engine, tiny_checkpoint):
    _, tok, _ = tiny_checkpoint
    with pytest.raises(WeightUpdateError, match="no weight update in progress"):
        engine.finish_weight_update()
    engine.begin_weight_update()
    try:
        with pytest.raises(WeightUpdateError, match="already in progress"):
            engine.begin_weight_update()
        with pytest.raises(WeightUpdateError, match="in progress"):
            engine.generate(encode(tok)[:1], SamplingParams(max_tokens=2))
    finally:
        engine.abort_weight_update()
    assert not engine.weight_update_in_progress
    with pytest.raises(AttributeError):
        engine.weight_version = 5  # read-only: the engine is its only writer


def test_a_bad_reload_is_caught_and_blocks_generation(engine, tiny_checkpoint, monkeypatch):
    """What vLLM received is not what was sent (k and v of layer 0 swapped on the way in):
    the post-reload check names the layer, the version stays, generate refuses until a
    complete update succeeds."""
    _, tok, model = tiny_checkpoint
    refit_from_model(engine, model)
    v0 = engine.weight_version
    real_rpc = engine.llm.collective_rpc

    def swapping_rpc(method, *args, kwargs=None, **kw):
        if method == "reload_weights":
            pairs = dict(kwargs["weights_iterator"])
            k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
            pairs[k], pairs[v] = pairs[v], pairs[k]
            kwargs = {**kwargs, "weights_iterator": list(pairs.items())}
        return real_rpc(method, *args, kwargs=kwargs, **kw)

    monkeypatch.setattr(engine.llm, "collective_rpc", swapping_rpc)
    with pytest.raises(WeightUpdateError, match="layers.0.self_attn.qkv_proj"):
        refit_from_model(engine, perturbed(model, seed=5))
    assert engine.weight_version == v0
    with pytest.raises(WeightUpdateError, match="failed"):
        engine.generate(encode(tok)[:1], SamplingParams(max_tokens=2))
    monkeypatch.undo()
    refit_from_model(engine, model)
    assert engine.weight_version == v0 + 1
    engine.generate(encode(tok)[:1], SamplingParams(max_tokens=2))


def test_tied_head_is_refreshed_after_reload(engine, tiny_checkpoint, monkeypatch):
    """vLLM's reload leaves a tied LM head's packed GEMM on the old embedding (CPU); the
    engine rebuilds it, and without that the post-reload check catches the stale head."""
    _, _, model = tiny_checkpoint
    assert engine.weight_routes.tied
    import hybridrl.vllm_backend.engine as engine_module

    monkeypatch.setattr(engine_module, "refresh_tied_head", lambda model, routes: None)
    with pytest.raises(WeightUpdateError, match="lm_head"):
        refit_from_model(engine, perturbed(model, seed=6))
    monkeypatch.undo()
    refit_from_model(engine, model)


def test_staged_views_survive_a_reused_bucket(engine, tiny_checkpoint):
    """Tensors that are views into a larger buffer (a transport bucket refilled before the
    update finishes) are copied when staged; the engine holds what was sent."""
    _, tok, model = tiny_checkpoint
    new = perturbed(model, seed=8)
    named = [(n, p.detach()) for n, p in new.named_parameters()]
    buffer = torch.empty(sum(t.numel() for _, t in named))
    with engine.weight_update():
        off = 0
        for name, t in named:
            view = buffer[off:off + t.numel()].view(t.shape)
            view.copy_(t)
            engine.load_weights([(name, view)])
            off += t.numel()
        buffer.fill_(float("nan"))  # the "bucket" is reused before finish
    prompts = encode(tok)
    for p, toks in zip(prompts, _greedy(engine, prompts)):
        assert_greedy_matches(new, p, toks)


def test_seeds_n_stop_tokens_and_finish_reasons(engine, tiny_checkpoint):
    _, tok, model = tiny_checkpoint
    refit_from_model(engine, perturbed(model, seed=9))
    prompts = encode(tok)
    params = [SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=100 + i) for i in range(len(prompts))]
    free = engine.generate(prompts, params).response_token_ids
    stops = (free[0][3],)  # row 0 (same seed) now stops by step 3; rows without it run to the length
    params = [dataclasses.replace(p, stop_token_ids=stops) for p in params]
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    assert a.response_token_ids == b.response_token_ids and torch.equal(a.logprobs, b.logprobs)
    assert [p for p in a.prompt_token_ids] == [p for p in prompts for _ in range(3)]  # n rows consecutive
    assert len({tuple(r) for r in a.response_token_ids}) > 1  # distinct seeds per sample
    for toks, reason in zip(a.response_token_ids, a.finish_reasons):
        if reason == "stop":
            assert toks[-1] in stops and not set(toks[:-1]) & set(stops)
        else:
            assert reason == "length" and len(toks) == 8 and not set(toks) & set(stops)
    assert {"stop", "length"} <= set(a.finish_reasons)
    # Unseeded requests draw their seeds from torch's global RNG: reproducible under manual_seed.
    torch.manual_seed(0)
    c = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6))
    torch.manual_seed(0)
    d = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6))
    assert c.response_token_ids == d.response_token_ids
    # max_tokens is capped by max_seq_len, like the built-in engine.
    long = [tok.bos_token_id] + [5] * (MAX_SEQ - 3)
    r = engine.generate([long], SamplingParams(temperature=0.0, max_tokens=20))
    assert len(r.response_token_ids[0]) <= 2 and r.finish_reasons == ["length"]


def test_prompt_validation(engine):
    with pytest.raises(ValueError, match="did the tokenizer encode it to nothing"):
        engine.generate([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="vocab_size"):
        engine.generate([[1, 10_000]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate([[1] * MAX_SEQ], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 3, 1.0), (0.7, 0, 0.8), (0.7, 4, 0.9)])
def test_truncated_sampling_reports_full_vocabulary_logprobs(engine, tiny_checkpoint, temperature, top_k, top_p):
    """With top-k / top-p on, the reported log-prob is log_softmax(logits / T) over the full
    vocabulary (the built-in engine's definition and the trainer's recompute), not vLLM's
    truncated, renormalized one: equal to the recompute within 1e-4 (float32), and below the
    truncated value by -log(kept mass) wherever that mass is < 1. A greedy request in the same
    batch reports log_softmax(logits)."""
    from hybridrl.trainer.forward import ForwardOptions, compute_logprobs_entropy

    _, tok, model = tiny_checkpoint
    new = perturbed(model, seed=10, scale=0.15)  # flatter logits: truncation removes real mass
    refit_from_model(engine, new)
    prompts = encode(tok)
    sampled = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=10, n=3, seed=11)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    ro = engine.generate(prompts, [sampled] * (len(prompts) - 1) + [greedy])
    rows = 3 * (len(prompts) - 1)
    mask = ro.response_mask.bool()
    with torch.no_grad():
        lp, _ = compute_logprobs_entropy(new, ro.input_ids, ro.attention_mask, ro.response_mask,
                                         options=ForwardOptions(temperature=temperature))
        lp_greedy, _ = compute_logprobs_entropy(new, ro.input_ids, ro.attention_mask, ro.response_mask,
                                                options=ForwardOptions(temperature=0.0))
    assert (lp - ro.logprobs)[:rows][mask[:rows]].abs().max() < 1e-4
    assert (lp_greedy - ro.logprobs)[rows:][mask[rows:]].abs().max() < 1e-4
    truncated = _truncated_logprobs(new, ro, temperature, top_k, top_p)[:rows][mask[:rows]]
    full = ro.logprobs[:rows][mask[:rows]]
    assert (truncated >= full - 1e-5).all() and (truncated - full).max() > 1e-2  # truncation mattered


@torch.no_grad()
def _truncated_logprobs(model, ro, temperature, top_k, top_p) -> torch.Tensor:
    """vLLM's processed_logprobs: log-probs renormalized over the top-k / top-p tokens ([B, L])."""
    logits = model(ro.input_ids, attention_mask=ro.attention_mask).logits.float() / temperature
    out = torch.zeros(ro.input_ids.shape)
    probs = logits[:, :-1].softmax(-1)  # position t predicts token t + 1
    sorted_p, order = probs.sort(-1, descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k > 0:
        keep[..., top_k:] = False
    kept = sorted_p * keep
    keep &= (kept.cumsum(-1) - kept) < top_p * kept.sum(-1, keepdim=True)
    kept_mass = (sorted_p * keep).sum(-1)  # (B, L-1)
    target = ro.input_ids[:, 1:]
    out[:, 1:] = probs.gather(-1, target.unsqueeze(-1)).squeeze(-1).log() - kept_mass.log()
    return out


def test_sleep_wakes_weights_before_the_reload_and_the_kv_cache_after(engine, tiny_checkpoint, monkeypatch):
    """free_cache_engine: ``sleep()`` frees the KV cache for the update; the refit wakes the
    weights before vLLM's reload and the KV cache after it; ``generate`` wakes a sleeping
    engine. On CPU vLLM's worker ignores sleep / wake_up, but its scheduler pauses and resumes
    for real: the order is recorded on the real engine."""
    _, tok, model = tiny_checkpoint
    prompts, params = encode(tok)[:2], SamplingParams(temperature=1.0, max_tokens=3, seed=0)
    calls = record_llm_calls(engine.llm, monkeypatch)
    monkeypatch.setattr(engine.sleep_state, "enabled", True)  # what free_cache_engine=True sets
    engine.generate(prompts, params)
    engine.sleep()
    engine.sleep()  # asleep already: nothing
    assert engine.llm.llm_engine.is_sleeping()
    refit_from_model(engine, perturbed(model, seed=12), verify=True)
    assert not engine.llm.llm_engine.is_sleeping()
    engine.generate(prompts, params)
    assert calls == ["generate", "sleep(1)", "wake_up(weights)", "reload_weights", "wake_up(kv_cache)",
                     "reset_prefix_cache", "generate"]

    calls.clear()  # a generate while asleep (e.g. an eval without a refit) wakes weights, then the KV cache
    engine.sleep()
    assert engine.generate(prompts, params).weight_version == engine.weight_version
    assert calls == ["sleep(1)", "wake_up(weights)", "wake_up(kv_cache)", "generate"]

    calls.clear()  # an update that never reached vLLM leaves it asleep; the next update wakes it
    engine.sleep()
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="in progress"):
        engine.sleep()
    engine.abort_weight_update()
    refit_from_model(engine, model)
    assert calls == ["sleep(1)", "wake_up(weights)", "reload_weights", "wake_up(kv_cache)", "reset_prefix_cache"]

    calls.clear()
    monkeypatch.setattr(engine.sleep_state, "enabled", False)
    engine.sleep()  # free_cache_engine off: a no-op
    assert calls == [] and not engine.llm.llm_engine.is_sleeping()


def test_torch_state_is_restored_around_vllm(engine, tiny_checkpoint):
    """vLLM replaces torch.set_num_threads, drops the thread count and reseeds the global
    RNGs; the engine puts all of it back around every call."""
    import random

    _, tok, model = tiny_checkpoint
    assert torch.set_num_threads.__name__ == "set_num_threads"
    threads = torch.get_num_threads()
    torch.manual_seed(42)
    random.seed(42)
    expected_t, expected_r = torch.rand(3), random.random()
    torch.manual_seed(42)
    random.seed(42)
    engine.generate(encode(tok), SamplingParams(temperature=1.0, max_tokens=4, seed=1))
    refit_from_model(engine, model)
    assert torch.equal(torch.rand(3), expected_t) and random.random() == expected_r
    assert torch.get_num_threads() == threads
    torch.set_num_threads(1)
    try:
        assert torch.get_num_threads() == 1  # the real function, not vLLM's no-op
    finally:
        torch.set_num_threads(threads)


def test_unsupported_head_dim_is_rejected_at_construction():
    """vLLM's CPU attention has a fixed head-size list; fail when building, not mid-run."""
    from hybridrl.job.model_factory import builtin_model, builtin_tokenizer
    from hybridrl.config import ModelConfig
    from hybridrl.rollout import EngineSpec
    from hybridrl.vllm_backend import VllmEngine

    cfg = builtin_model(builtin_tokenizer(), ModelConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32, tie_word_embeddings=True)).config
    with pytest.raises(ValueError, match="head_dim=16"):
        VllmEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=8))
