"""DeepSeek-V3 (MLA + DeepSeekMoE) in the rollout engine vs transformers' DeepseekV3ForCausalLM.

Configs are drawn fresh per run (``_deepseek.draw_config``; the seed is in every failure
message): q-LoRA or not, YaRN or default RoPE, interleaved or not, several groups, leading
dense layers, shared experts, tied heads.
"""
import random

import pytest
import torch

from hybridrl.refit import RefitError, refit_from_model
from hybridrl.refit.transport import named_trainer_tensors
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.derived import DerivedCacheError
from hybridrl.rollout.models.deepseek_v3.mla import MlaAttention, set_decode_mode
from hybridrl.rollout.model_config import parse_hf_config
from _greedy import assert_greedy_matches
from tests.rollout import _deepseek as ds


def _left_padded(rng_t, B, S, vocab):
    ids = torch.randint(0, vocab, (B, S), generator=rng_t)
    mask = torch.ones(B, S, dtype=torch.long)
    for b in range(B):
        mask[b, : int(torch.randint(0, S // 2, (1,), generator=rng_t))] = 0
    return ids, mask


@pytest.mark.parametrize("draw", range(4))
def test_logits_match_transformers_on_drawn_configs_with_left_padding(draw):
    seed = ds.fresh_seed()
    cfg = ds.draw_config(random.Random(seed))
    hf = ds.hf_model(cfg, seed=seed % 1000)
    eng = ds.engine(cfg, hf)
    g = torch.Generator().manual_seed(seed)
    ids, mask = _left_padded(g, 4, 24, cfg.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    got = eng.logits(ids, mask)
    m = mask.bool()
    err = ((got[m] - ref[m]).abs().max() / ref[m].abs().max()).item()
    assert err < 1e-5, f"seed {seed}: relative error {err:.2e} (config {cfg.to_diff_dict()})"


@pytest.mark.parametrize("draw", range(3))
def test_greedy_tokens_and_logprobs_match_transformers_with_continuous_batching(draw):
    """Prompts of different lengths through the scheduler (max_batch_size 3 < 6 prompts: rows
    are refilled as requests finish); latent-space decode."""
    seed = ds.fresh_seed()
    cfg = ds.draw_config(random.Random(seed))
    hf = ds.hf_model(cfg, seed=seed % 1000)
    eng = ds.engine(cfg, hf, max_batch_size=3)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 17, (6,), generator=g)]
    out = eng.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    for i, p in enumerate(prompts):
        assert_greedy_matches(hf, p, out.response_token_ids[i], what=f"seed {seed}, prompt {i}:")
    with torch.no_grad():
        lp = torch.log_softmax(hf(input_ids=out.input_ids, attention_mask=out.attention_mask).logits, -1)
    ref_lp = lp[:, :-1].gather(-1, out.input_ids[:, 1:, None])[..., 0]
    m = out.response_mask[:, 1:].bool()
    err = (ref_lp[m] - out.logprobs[:, 1:][m]).abs().max().item()
    assert err < 1e-5, f"seed {seed}: log-prob error {err:.2e}"


def test_absorbed_and_decompressed_decode_agree_and_sampling_is_seeded():
    cfg = ds.config()
    hf = ds.hf_model(cfg, seed=3)
    eng = ds.engine(cfg, hf)
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (4, 11, 7)]
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=100 + i) for i in range(3)]
    absorbed = eng.generate(prompts, params)
    set_decode_mode(eng.model, "decompress")
    expanded = eng.generate(prompts, params)
    assert absorbed.response_token_ids == expanded.response_token_ids
    torch.testing.assert_close(absorbed.logprobs, expanded.logprobs, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="MLA decode mode"):
        set_decode_mode(eng.model, "fast")


def test_latent_cache_holds_one_shared_latent_per_token_and_layer():
    cfg = ds.config()
    eng = ds.engine(cfg)
    dims = parse_hf_config(cfg).mla
    latent = eng.runner.kv_cache.latent
    assert tuple(latent.shape) == (cfg.num_hidden_layers, 8, 1, 96, dims.kv_lora_rank + dims.qk_rope_head_dim)
    assert [n for n, _ in eng.runner.kv_cache.named_tensors()] == ["kv_cache.latent"]
    per_token = cfg.num_hidden_layers * (dims.kv_lora_rank + dims.qk_rope_head_dim) * 4
    assert eng.runner.kv_cache.bytes_per_token == per_token
    gqa = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * dims.qk_head_dim * 4  # the same heads as k/v
    assert per_token < gqa / 3


def test_conversation_continuation_and_refit_mid_answer_on_the_latent_cache():
    """Turn 2 continues turn 1's retained latent rows (parent=); then a refit lands while a
    request is mid-answer and kv_on_refit=recompute rebuilds its latent cache under the new
    weights: every token's log-prob equals transformers' under the version that sampled it."""
    cfg = ds.config()
    hf_a, hf_b = ds.hf_model(cfg, seed=1), ds.hf_model(cfg, seed=2)
    eng = ds.engine(cfg, hf_a)
    prompt = torch.randint(0, cfg.vocab_size, (9,)).tolist()
    eng.add_request("t1", prompt, SamplingParams(max_tokens=6, temperature=0.0), retain=True)
    first = eng.run_until_finished(["t1"])["t1"]
    turn2 = prompt + first.token_ids + torch.randint(0, cfg.vocab_size, (5,)).tolist()
    eng.add_request("t2", turn2, SamplingParams(max_tokens=6, temperature=0.0), parent="t1")
    second = eng.run_until_finished(["t2"])["t2"]
    assert eng.scheduler.prefixes.hits == 1
    assert_greedy_matches(hf_a, turn2, second.token_ids)

    eng.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    for _ in range(4):
        eng.step()
    refit_from_model(eng, hf_b, verify=True)
    out = eng.run_until_finished(["r"])["r"]
    seq = torch.tensor([prompt + out.token_ids])
    versions = out.token_versions
    assert set(versions) == {1, 2} and versions == sorted(versions)
    for model, version in ((hf_a, 1), (hf_b, 2)):
        with torch.no_grad():
            lp = torch.log_softmax(model(seq).logits, -1)[0, len(prompt) - 1:-1]
        ref_lp = lp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        idx = [i for i, v in enumerate(versions) if v == version]
        torch.testing.assert_close(torch.tensor(out.logprobs)[idx], ref_lp[idx], rtol=0, atol=1e-5)


def _fp8_config(**kw):
    # fp8_block needs every fused shard but the last to span whole 128-row tiles (gate_up)
    return ds.config(intermediate_size=128, moe_intermediate_size=64, n_shared_experts=2, **kw)


@pytest.mark.parametrize("quantization", [None, "fp8", "fp8_block", "fp8_block+mxfp4"])
def test_refit_a_to_b_is_bitwise_a_fresh_load_of_b_absorbed_caches_included(quantization):
    cfg = _fp8_config()
    hf_a, hf_b = ds.hf_model(cfg, seed=5), ds.hf_model(cfg, seed=6)
    refitted = ds.engine(cfg, hf_a, quantization=quantization)
    before = {n: t.data_ptr() for n, t in refitted.named_state_tensors()}
    refit_from_model(refitted, hf_b, verify=True)
    fresh = ds.engine(cfg, hf_b, quantization=quantization)
    state = dict(refitted.named_state_tensors())
    assert {n: t.data_ptr() for n, t in state.items()} == before
    for name, t in fresh.named_state_tensors():
        if not name.startswith("kv_cache"):
            assert torch.equal(state[name], t), name
    caches = dict(refitted.named_derived_caches())
    assert sum(n.endswith((".w_uk", ".w_uv")) for n in caches) == 2 * cfg.num_hidden_layers
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (5, 12)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    a, b = refitted.generate(prompts, params), fresh.generate(prompts, params)
    assert a.response_token_ids == b.response_token_ids and torch.equal(a.logprobs, b.logprobs)


def test_absorbed_caches_come_from_the_dequantized_fp8_kv_b_proj():
    cfg = _fp8_config()
    eng = ds.engine(cfg, ds.hf_model(cfg, seed=7), quantization="fp8")
    attn = next(m for m in eng.model.modules() if isinstance(m, MlaAttention))
    w = attn.kv_b_proj.weight_dequant.view(attn.num_heads, -1, attn.rank)  # the FP8 layer's own dequantization
    assert torch.equal(attn.w_uk, w[:, :attn.nope])
    assert torch.equal(attn.w_uv, w[:, attn.nope:].transpose(1, 2))


def test_skipped_absorbed_refresh_fails_the_refit_verifier(monkeypatch):
    cfg = ds.config()
    hf_a, hf_b = ds.hf_model(cfg, seed=8), ds.hf_model(cfg, seed=9)
    eng = ds.engine(cfg, hf_a)
    for name, cache in eng.named_derived_caches():
        if name.endswith(".w_uk"):
            monkeypatch.setattr(cache, "refresh", lambda: None)
            break
    with pytest.raises(RefitError, match=r"stale derived caches.*w_uk"):
        refit_from_model(eng, hf_b, verify=True)


def test_absorbed_refresh_before_the_fp8_restore_is_refused():
    cfg = _fp8_config()
    eng = ds.engine(cfg, ds.hf_model(cfg, seed=10), quantization="fp8")
    cache = next(c for n, c in eng.named_derived_caches() if n.endswith(".w_uv"))
    eng.begin_weight_update()  # every FP8 layer back in loading layout
    with pytest.raises(DerivedCacheError, match="w_uv.*not in inference layout"):
        cache.refresh()
    eng.abort_weight_update()
    cache.refresh()  # fine once the layouts are restored


def test_routing_record_is_the_grouped_routers_choice_and_replays_in_transformers():
    from hybridrl.rollout.routing import replay_routing

    cfg = ds.config()
    hf = ds.hf_model(cfg, seed=11)
    eng = ds.engine(cfg, hf, record_routing=True)
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (6, 10)]
    out = eng.generate(prompts, SamplingParams(max_tokens=6, temperature=1.0, seed=3))
    routed = out.routed_experts  # [B, L, n_moe_layers, k]
    assert routed.shape[2:] == (cfg.num_hidden_layers - cfg.first_k_dense_replace, cfg.num_experts_per_tok)
    # transformers' own routers choose the same experts for every fed token
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: chosen.append(o[2]))
             for layer in hf.model.layers[cfg.first_k_dense_replace:]]
    with torch.no_grad():
        base = hf(input_ids=out.input_ids, attention_mask=out.attention_mask).logits
    for h in hooks:
        h.remove()
    fed = (routed >= 0).all(-1).all(-1)  # [B, L]
    for layer, ids in enumerate(chosen):
        ids = ids.view(*out.input_ids.shape, -1)[fed].sort(-1).values
        rec = routed[:, :, layer][fed].long().sort(-1).values
        agree = (ids == rec).all(-1).float().mean().item()
        assert agree == 1.0, f"MoE layer {layer}: {agree:.3f} of tokens routed alike"
    with torch.no_grad(), replay_routing(hf, routed):
        replayed = hf(input_ids=out.input_ids, attention_mask=out.attention_mask).logits
    m = out.attention_mask.bool()
    torch.testing.assert_close(replayed[m], base[m], rtol=0, atol=1e-5)


def test_absorbed_prefill_equals_decompressed_prefill():
    """The latent-space form also serves many queries (the benchmark's prefill comparison):
    same logits and the same greedy continuation after a conversation turn (extend)."""
    cfg = ds.config()
    hf = ds.hf_model(cfg, seed=12)
    eng = ds.engine(cfg, hf)
    ids = torch.randint(0, cfg.vocab_size, (3, 20))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    expanded = eng.logits(ids, mask)
    set_decode_mode(eng.model, "absorb", prefill=True)
    absorbed = eng.logits(ids, mask)
    m = mask.bool()
    torch.testing.assert_close(absorbed[m], expanded[m], rtol=0, atol=2e-5)
    prompt = torch.randint(0, cfg.vocab_size, (9,)).tolist()
    eng.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0.0), retain=True)
    first = eng.run_until_finished(["a"])["a"].token_ids
    turn = prompt + first + [3, 5, 7]
    eng.add_request("b", turn, SamplingParams(max_tokens=5, temperature=0.0), parent="a")
    assert_greedy_matches(hf, turn, eng.run_until_finished(["b"])["b"].token_ids)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantization", [None, "fp8", "fp8_block+mxfp4"])
def test_graph_replay_follows_verified_refits_of_kv_b_proj(quantization):
    """The captured decode graph reads w_uk / w_uv at fixed addresses: after each verified
    refit (new kv_b_proj, FP8 re-quantized, absorbed caches refreshed in place) replay equals
    an eager engine loaded with the same weights."""
    from hybridrl.rollout import EngineSpec, RolloutEngine
    from tests.rollout.test_cuda_graph import _decode_both

    cfg = _fp8_config()
    spec = EngineSpec(max_batch_size=4, max_seq_len=64, dtype=torch.float32, device="cuda", quantization=quantization)
    graph, eager = RolloutEngine(cfg, spec), RolloutEngine(cfg, spec, enforce_eager=True)
    for seed in range(3):
        hf = ds.hf_model(cfg, seed=40 + seed).cuda()
        refit_from_model(graph, hf, verify=True)
        refit_from_model(eager, hf, verify=True)
        if seed == 0:
            assert graph.runner.graphs is not None
            caches = {n: c.tensor.data_ptr() for n, c in graph.named_derived_caches()}
        assert {n: c.tensor.data_ptr() for n, c in graph.named_derived_caches()} == caches
        for ours, ref in _decode_both(graph, eager, 3, seed=seed):
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
