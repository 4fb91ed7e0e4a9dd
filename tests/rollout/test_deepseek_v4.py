"""DeepSeek-V4 (issue #32) in the rollout engine vs transformers' DeepseekV4ForCausalLM.

Configs drawn fresh per run (seed in the failure message; ``tests/rollout/_deepseek_v4.py``):
every layer type (sliding, CSA, HCA), 1-32 indexer heads, ``index_topk`` below and above the
block count, both routers (hash, top-k), hc_mult 2-4, sqrtsoftplus or sigmoid scoring,
default or YaRN compress rope, tied or not; sequences several times the window and the
compression rates, right-padded batches. The reference is transformers with hybridrl's
indexer selection (ties to the most recent entry, ``reference``); exact ties are kept.
"""
import contextlib
import random

import pytest
import torch
import transformers

from hybridrl.refit.transport import named_trainer_tensors
from hybridrl.rollout.models.deepseek_v4.config import v4_model_config
from hybridrl.rollout.model_config import ModelConfig, parse_hf_config
from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.layers.linear_method import UnquantizedLinearMethod
from hybridrl.rollout.models.deepseek_v4.model import DeepseekV4ForCausalLM
from hybridrl.rollout.weight_routes import WeightRoutes
from hybridrl.rollout.weight_update import WeightUpdate
from tests.rollout._deepseek import fresh_seed
from tests.rollout._deepseek_v4 import TYPES, VOCAB, draw_config, drawn, hf_model, reference

def engine_model(hf, cfg, max_seq_len=256):
    model_cfg = parse_hf_config(cfg)
    ctx = LayerContext(linear_method=UnquantizedLinearMethod(), dtype=torch.float32, device=torch.device("cpu"))
    model = DeepseekV4ForCausalLM(model_cfg, model_cfg.v4, max_seq_len, ctx)
    update = WeightUpdate(model, WeightRoutes(model))
    update.begin()
    update.load(named_trainer_tensors(hf))
    update.finish()  # raises if any expected name was not written
    return model


@pytest.mark.parametrize("draw", range(4))
def test_stateless_logits_match_transformers_on_drawn_configs(draw):
    seed = fresh_seed()
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    cfg, hf = drawn(seed, probe_len=160)
    ids = torch.randint(0, VOCAB, (3, int(torch.randint(100, 161, (1,), generator=g))), generator=g)
    lengths = [ids.shape[1], ids.shape[1] - 17, ids.shape[1] - 40]
    valid = torch.arange(ids.shape[1]).view(1, -1) < torch.tensor(lengths).view(-1, 1)
    model = engine_model(hf, cfg)
    with torch.no_grad():
        got = model.logits(ids, valid)
        for b, n in enumerate(lengths):  # each row alone (right padding must not change its logits)
            ref = reference(hf, input_ids=ids[b:b + 1, :n]).logits[0]
            err = float((got[b, :n] - ref).abs().max() / ref.abs().max())
            assert err < 1e-4, f"seed {seed} row {b}: relative error {err:.2e} ({cfg.to_diff_dict()})"


@pytest.mark.parametrize("field, value, key", [
    ("layer_types", ["sliding_attention"] * 2, "layer_types"),
    ("mlp_layer_types", ["moe", "dense", "moe"], "mlp_layer_types"),
    ("scoring_func", "softmax", "scoring_func"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("o_groups", 3, "o_groups"),
])
def test_bad_v4_configs_fail_naming_the_key(field, value, key):
    cfg = draw_config(random.Random(0), num_hidden_layers=3, layer_types=TYPES,
                      mlp_layer_types=["hash_moe", "moe", "moe"])
    setattr(cfg, field, value)
    with pytest.raises(ValueError) as err:
        parse_hf_config(cfg)
    assert "\n" not in str(err.value) and f"{key}=" in str(err.value)


def test_a_layer_types_list_transformers_would_truncate_is_refused():
    cfg = draw_config(random.Random(1), num_hidden_layers=3, layer_types=TYPES,
                      mlp_layer_types=["hash_moe", "moe", "moe"])
    raw = {"layer_types": TYPES + ["sliding_attention"]}  # config.json with 4 entries for 3 layers
    with pytest.raises(ValueError, match=r"layer_types=.*must have num_hidden_layers=3 entries"):
        v4_model_config(cfg, ModelConfig, raw)


# ---- the engine: state cache, scheduler, refit ---------------------------------------------
def _engine(cfg, hf=None, record_routing=False, **spec):
    from hybridrl.rollout import EngineSpec, RolloutEngine

    eng = RolloutEngine(cfg, EngineSpec(**{"max_batch_size": 3, "max_seq_len": 128, "dtype": torch.float32, **spec}),
                        record_routing=record_routing)
    if hf is not None:
        eng.load_weights(named_trainer_tensors(hf))
    return eng


def _greedy_reference(hf, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(reference(hf, input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]



@pytest.mark.parametrize("draw", range(2))
def test_engine_greedy_and_logprobs_through_the_scheduler_match_transformers(draw):
    """5 prompts through 3 rows (rows refilled and compacted as requests finish), decoding past
    the window and several compression windows from the per-request state."""
    from hybridrl.rollout import SamplingParams

    seed = fresh_seed()
    cfg, hf = drawn(seed)
    eng = _engine(cfg, hf)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(5, 45, (5,), generator=g)]
    out = eng.generate(prompts, [SamplingParams(max_tokens=int(n), temperature=0.0) for n in (24, 9, 30, 16, 24)])
    for i, p in enumerate(prompts):
        assert out.response_token_ids[i] == _greedy_reference(hf, p, len(out.response_token_ids[i])), f"seed {seed} {i}"
    sampled = eng.generate(prompts, SamplingParams(max_tokens=20, temperature=1.0, seed=7))
    with torch.no_grad():
        for b in range(len(prompts)):
            n = int(sampled.attention_mask[b].sum())
            ref = torch.log_softmax(reference(hf, input_ids=sampled.input_ids[b:b + 1, :n]).logits[0], -1)
            want = ref[:-1].gather(-1, sampled.input_ids[b, 1:n, None])[:, 0]
            resp = sampled.response_mask[b, 1:n].bool()
            err = float((want[resp] - sampled.logprobs[b, 1:n][resp]).abs().max())
            assert err < 1e-4, f"seed {seed} row {b}: {err:.2e}"


def test_engine_logits_with_left_padding_and_continuations_recompute():
    from hybridrl.rollout import SamplingParams

    cfg, hf = drawn(11)
    eng = _engine(cfg, hf)
    ids = torch.randint(0, VOCAB, (2, 60))
    mask = torch.ones_like(ids)
    mask[1, :23] = 0  # left padded
    got = eng.logits(ids, mask)
    ref = reference(hf, input_ids=ids[1:, 23:]).logits[0]
    torch.testing.assert_close(got[1, 23:], ref, rtol=0, atol=1e-4 * float(ref.abs().max()))
    prompt = torch.randint(0, VOCAB, (30,)).tolist()
    eng.add_request("t1", prompt, SamplingParams(max_tokens=8, temperature=0.0), retain=True)
    first = eng.run_until_finished(["t1"])["t1"]
    turn = prompt + first.token_ids + [5, 6, 7]
    eng.add_request("t2", turn, SamplingParams(max_tokens=10, temperature=0.0), parent="t1")
    assert eng.run_until_finished(["t2"])["t2"].token_ids == _greedy_reference(hf, turn, 10)
    assert eng.scheduler.prefixes.hits == 0  # V4's state is not retained: the continuation was recomputed


def test_refit_a_to_b_equals_a_fresh_load_of_b_and_a_refit_mid_answer_recomputes_the_state():
    from hybridrl.refit import refit_from_model
    from hybridrl.rollout import SamplingParams

    cfg, hf_a = drawn(12)
    hf_b = hf_model(cfg, 99)
    refitted = _engine(cfg, hf_a)
    before = {n: t.data_ptr() for n, t in refitted.named_state_tensors()}
    refit_from_model(refitted, hf_b, verify=True)
    fresh = _engine(cfg, hf_b)
    state = dict(refitted.named_state_tensors())
    assert {n: t.data_ptr() for n, t in state.items()} == before
    for name, t in fresh.named_state_tensors():
        if not name.startswith("kv_cache"):
            assert torch.equal(state[name], t), name
    prompt = torch.randint(0, VOCAB, (26,)).tolist()
    eng = _engine(cfg, hf_a)
    eng.add_request("r", prompt, SamplingParams(max_tokens=14, temperature=0.0))
    for _ in range(6):
        eng.step()
    refit_from_model(eng, hf_b, verify=True)  # kv_on_refit=recompute: the state is rebuilt under B
    out = eng.run_until_finished(["r"])["r"]
    seq = torch.tensor([prompt + out.token_ids])
    for model, version in ((hf_a, 1), (hf_b, 2)):
        lp = torch.log_softmax(reference(model, input_ids=seq).logits, -1)[0, len(prompt) - 1:-1]
        ref = lp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        idx = [i for i, v in enumerate(out.token_versions) if v == version]
        assert idx, version
        torch.testing.assert_close(torch.tensor(out.logprobs)[idx], ref[idx], rtol=0, atol=1e-4)


def _quant_config(**kw):
    # fp8_block needs the fused shared-expert gate/up in whole 128-row tiles; mxfp4 K % 32
    return draw_config(random.Random(3), moe_intermediate_size=128, num_hidden_layers=3, layer_types=TYPES,
                       mlp_layer_types=["hash_moe", "moe", "moe"], **kw)


@pytest.mark.parametrize("quantization", [None, "fp8", "fp8_block", "fp8_block+mxfp4"])
def test_quantized_refit_a_to_b_is_bitwise_a_fresh_load_of_b(quantization):
    """Including the grouped o_a_proj's dequantized cache — seed PR #7455's bf16 wo_a copy."""
    from hybridrl.refit import refit_from_model
    from hybridrl.rollout import SamplingParams

    cfg = _quant_config()
    hf_a, hf_b = hf_model(cfg, 21), hf_model(cfg, 22)
    refitted = _engine(cfg, hf_a, quantization=quantization)
    before = {n: t.data_ptr() for n, t in refitted.named_state_tensors()}
    refit_from_model(refitted, hf_b, verify=True)
    fresh = _engine(cfg, hf_b, quantization=quantization)
    state = dict(refitted.named_state_tensors())
    assert {n: t.data_ptr() for n, t in state.items()} == before
    for name, t in fresh.named_state_tensors():
        if not name.startswith("kv_cache"):
            assert torch.equal(state[name], t), name
    if quantization:
        assert any(n.endswith("o_a_proj.weight_dequant") for n, _ in refitted.named_derived_caches())
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (12, 40)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    a, b = refitted.generate(prompts, params), fresh.generate(prompts, params)
    assert a.response_token_ids == b.response_token_ids and torch.equal(a.logprobs, b.logprobs)


def test_the_seed_prs_two_failure_modes_are_caught(monkeypatch):
    """Seed PR #7455: (1) the wo_a copy dropped and rebuilt lazily in new storage — a captured
    graph would read freed memory; (2) rebuilt before the FP8 weights are back in inference
    layout. Ours refuses both: (1) a rebinding fails the refresh (and the address check),
    a skipped refresh fails the verifier; (2) the refresh refuses while the layout is restored."""
    from hybridrl.refit import RefitError, refit_from_model
    from hybridrl.rollout.derived import DerivedCacheError
    from hybridrl.rollout.layers import fp8_linear

    monkeypatch.setattr(fp8_linear, "FNUZ_DEFAULT", True)  # a loading != inference layout, as on ROCm
    cfg = _quant_config()
    eng = _engine(cfg, hf_model(cfg, 23), quantization="fp8_block")
    name, cache = next((n, c) for n, c in eng.named_derived_caches() if n.endswith("o_a_proj.weight_dequant"))
    layer = cache.module
    # (1a) drop and rebuild in new storage
    layer.register_buffer("weight_dequant", torch.empty_like(cache.tensor), persistent=False)
    with pytest.raises(DerivedCacheError, match="rebound to new storage"):
        refit_from_model(eng, hf_model(cfg, 24), verify=True)
    layer.register_buffer("weight_dequant", torch.empty(0), persistent=False)
    eng2 = _engine(cfg, hf_model(cfg, 23), quantization="fp8_block")
    cache2 = next(c for n, c in eng2.named_derived_caches() if n == name)
    # (1b) the refresh skipped: the verifier sees the stale copy
    monkeypatch.setattr(cache2, "refresh", lambda: None)
    with pytest.raises(RefitError, match=r"stale derived caches.*o_a_proj"):
        refit_from_model(eng2, hf_model(cfg, 24), verify=True)
    monkeypatch.undo()
    monkeypatch.setattr(fp8_linear, "FNUZ_DEFAULT", True)
    eng3 = _engine(cfg, hf_model(cfg, 23), quantization="fp8_block")
    cache3 = next(c for n, c in eng3.named_derived_caches() if n == name)
    # (2) refreshed while the FP8 weights are in loading layout
    eng3.begin_weight_update()
    with pytest.raises(DerivedCacheError, match="not in inference layout"):
        cache3.refresh()
    eng3.abort_weight_update()


def test_state_bytes_and_any_window_fits():
    """The state cache's bytes per token; and an engine whose max_seq_len is shorter than the
    sliding window (every ring then holds the whole row) samples what transformers computes:
    a prompt of one token decoded to the end of the row and a prompt that fills all but two
    slots, greedy, checked token by token against the reference over the same sequence."""
    from hybridrl.rollout import SamplingParams as SamplingParams_
    from tests.rollout._deepseek_v4 import UNEQUAL_NEAR_TIE, boundary_stats

    seed = fresh_seed()
    cfg, hf = drawn(seed)
    eng = _engine(cfg, max_seq_len=512)
    cache = eng.runner.kv_cache
    d = cfg.head_dim
    n_csa = cfg.layer_types.count("compressed_sparse_attention")
    n_hca = cfg.layer_types.count("heavily_compressed_attention")
    rates = cfg.compress_rates
    want = (n_csa * (d + cfg.index_head_dim) / rates["compressed_sparse_attention"]
            + n_hca * d / rates["heavily_compressed_attention"]) * 4
    assert cache.bytes_per_token == round(want), f"seed {seed}"
    assert cache.bytes_at(4096) < 2 * cfg.num_hidden_layers * d * 4 * 4096, f"seed {seed}"  # vs full attention's k + v
    L = cfg.sliding_window // 2 + 4
    short = _engine(cfg, hf, max_seq_len=L)  # any window fits the rings
    g = torch.Generator().manual_seed(seed)
    for _ in range(4):  # prompts whose sequences put no two unequal indexer scores within rounding
        prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, L - 2)]
        out = short.generate(prompts, SamplingParams_(max_tokens=L, temperature=0.0))
        seqs = [p + r for p, r in zip(prompts, out.response_token_ids)]
        if all(boundary_stats(hf, torch.tensor([q])).min_unequal_gap > UNEQUAL_NEAR_TIE for q in seqs):
            break
    else:
        pytest.fail(f"seed {seed}: every prompt drawn met an unequal near-tie in the indexer; widen the draw")
    for b, (prompt, seq) in enumerate(zip(prompts, seqs)):
        where = f"seed {seed}, max_seq_len {L}, row {b}, prompt {prompt}"
        assert len(seq) == L, f"{where}: the response stopped at {len(seq) - len(prompt)} tokens, not at the row's end"
        logits = reference(hf, input_ids=torch.tensor([seq])).logits[0, len(prompt) - 1:-1]  # [response, V]
        tokens = torch.tensor(seq[len(prompt):])
        chosen = logits.gather(-1, tokens[:, None])[:, 0]
        # greedy = the reference's argmax; where the reference's best two are within the engine/transformers
        # logit agreement (1e-4 of the largest logit, the stateless test's bound) either is the argmax
        margin = logits.max(-1).values - chosen
        bound = 1e-4 * logits.abs().amax(-1)
        assert torch.all((tokens == logits.argmax(-1)) | (margin <= bound)), \
            f"{where}: engine {tokens.tolist()} vs reference argmax {logits.argmax(-1).tolist()}"
        ref_logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
        got = torch.tensor(out.response_logprobs[b])
        err = float((got - ref_logprobs).abs().max())
        assert err < 1e-4, f"{where}: log-probs differ by {err:.2e}"


def test_routing_record_is_the_topk_routers_choice_replays_in_transformers_and_hash_layers_need_none():
    """The record covers the top-k router layers only; transformers' routers choose the same
    experts for every fed token; replaying the record changes nothing, replaying a different
    choice is obeyed; the hash routers' choice is tid2eid[token] in both, replay or not."""
    from hybridrl.rollout import SamplingParams
    from hybridrl.rollout.routing import replay_routing

    seed = fresh_seed()
    cfg, hf = drawn(seed)
    eng = _engine(cfg, hf, record_routing=True)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in (7, 30, 18, 44)]
    out = eng.generate(prompts, SamplingParams(max_tokens=20, temperature=1.0, seed=3))
    routed = out.routed_experts
    topk_layers = [i for i, t in enumerate(cfg.mlp_layer_types) if t == "moe"]
    assert routed.shape[2:] == (len(topk_layers), cfg.num_experts_per_tok)

    def routers_choice(ids, replay=None):
        chosen = {}
        hooks = [hf.model.layers[i].mlp.gate.register_forward_hook(
            lambda m, a, o, i=i: chosen.__setitem__(i, o[2])) for i in range(cfg.num_hidden_layers)]
        try:
            with (replay_routing(hf, replay) if replay is not None else contextlib.nullcontext()):
                logits = reference(hf, input_ids=ids).logits
        finally:
            for h in hooks:
                h.remove()
        return logits, chosen

    for b in range(len(prompts)):
        n = int(out.attention_mask[b].sum())
        ids, rec = out.input_ids[b:b + 1, :n], routed[b:b + 1, :n]
        fed = (rec[0] >= 0).all(-1).all(-1)  # every token but the last sampled one
        assert int(fed.sum()) == n - 1, f"seed {seed} row {b}"
        base, chosen = routers_choice(ids)
        for layer, i in enumerate(topk_layers):
            hf_ids = chosen[i].view(n, -1)[fed].sort(-1).values
            assert torch.equal(hf_ids, rec[0, fed, layer].long().sort(-1).values), f"seed {seed} row {b} layer {i}"
        for i, t in enumerate(cfg.mlp_layer_types):
            if t == "hash_moe":
                tid2eid = eng.model.model.layers[i].mlp.gate.tid2eid  # the engine's table (loaded by refit)
                assert torch.equal(chosen[i].view(n, -1), tid2eid[ids[0]])
        replayed, _ = routers_choice(ids, rec)
        torch.testing.assert_close(replayed[0, fed], base[0, fed], rtol=0, atol=1e-5)
        other = torch.where(rec >= 0, (rec + 1) % cfg.n_routed_experts, rec)  # a different valid choice
        _, forced = routers_choice(ids, other)
        for layer, i in enumerate(topk_layers):
            assert torch.equal(forced[i].view(n, -1)[fed], other[0, fed, layer].long())
        for i, t in enumerate(cfg.mlp_layer_types):
            if t == "hash_moe":
                assert torch.equal(forced[i], chosen[i])
