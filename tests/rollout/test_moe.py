"""Qwen3-MoE / Qwen2-MoE in the rollout engine vs transformers: logits, decode, greedy,
log-probs; grouped dispatch; the expert routes (fused and per-expert names); refit."""

import pytest
import torch
import transformers

from hybridrl.refit import RefitError, refit_from_model
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.rollout.layers import moe_dispatch
from hybridrl.rollout.layers.moe_dispatch import fused_experts
from hybridrl.rollout.model_config import parse_hf_config
from hybridrl.rollout.weight_update import WeightUpdateError
from tests.rollout.conftest import VOCAB, make_hf_model

MOE_FAMILIES = ["qwen3_moe", "qwen3_moe_step2", "qwen2_moe"]


def make_moe_config(family: str = "qwen3_moe", **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=128)
    if family == "qwen3_moe":  # layer 1 dense (mlp_only_layers), renormalized top-2
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=24, mlp_only_layers=[1], decoder_sparse_step=1,
                                          norm_topk_prob=True)
    elif family == "qwen3_moe_step2":  # layers 1, 3 sparse; raw top-3 probabilities; tied head
        cfg = transformers.Qwen3MoeConfig(**{**common, "num_experts_per_tok": 3}, decoder_sparse_step=2,
                                          norm_topk_prob=False, tie_word_embeddings=True)
    elif family == "qwen2_moe":  # q/k/v bias, shared expert with its sigmoid gate
        cfg = transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=48, mlp_only_layers=[2])
    else:
        raise KeyError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_moe_hf_model(cfg, seed: int = 0, dtype=torch.float32, eager_experts: bool = False):
    """Like conftest.make_hf_model (weights large enough that routing and greedy decoding are
    far from degenerate); ``eager_experts`` for float64 references (torch's grouped GEMM has none)."""
    kw = {"experts_implementation": "eager"} if eager_experts else {}
    return make_hf_model(cfg, seed, dtype, **kw)


def moe_engine(cfg, hf=None, *, max_batch_size=4, max_seq_len=64, dtype=torch.float32, quantization=None, **kw):
    spec = EngineSpec(max_batch_size=max_batch_size, max_seq_len=max_seq_len, dtype=dtype, quantization=quantization)
    engine = RolloutEngine(cfg, spec, **kw)
    if hf is not None:
        engine.load_weights(hf.named_parameters())
    return engine


def per_expert_state(hf) -> list[tuple[str, torch.Tensor]]:
    """``hf``'s weights under the per-expert names of safetensors checkpoints on disk."""
    out = []
    for name, t in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out += [(f"{base}{e}.gate_proj.weight", t[e, :inter]), (f"{base}{e}.up_proj.weight", t[e, inter:])]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[:-len("down_proj")]
            out += [(f"{base}{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
        else:
            out.append((name, t))
    return out


def close(ours, ref):
    ref = ref.to(torch.float32)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@pytest.fixture(params=MOE_FAMILIES)
def moe_family(request):
    return request.param


# ---- config ------------------------------------------------------------------------------
def test_config_layers_and_fields():
    c = parse_hf_config(make_moe_config("qwen3_moe"))
    assert c.moe_layers == (0, 2, 3) and c.num_experts == 8 and c.num_experts_per_tok == 2 and c.norm_topk_prob
    assert c.qk_norm and not c.qkv_bias and c.shared_expert_intermediate_size == 0
    c = parse_hf_config(make_moe_config("qwen3_moe_step2"))
    assert c.moe_layers == (1, 3) and c.num_experts_per_tok == 3 and not c.norm_topk_prob
    c = parse_hf_config(make_moe_config("qwen2_moe"))
    assert c.moe_layers == (0, 1, 3) and c.qkv_bias and not c.qk_norm and c.shared_expert_intermediate_size == 48
    with pytest.raises(ValueError, match="hidden_act"):
        parse_hf_config(make_moe_config("qwen3_moe", hidden_act="gelu"))


def test_engine_layers_mirror_hf_modules(moe_family):
    cfg = make_moe_config(moe_family)
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg)
    for i, (ours, theirs) in enumerate(zip(engine.model.model.layers, hf.model.layers)):
        assert ours.is_moe == hasattr(theirs.mlp, "experts"), i


# ---- numerics vs transformers -------------------------------------------------------------
def test_prefill_logits_match_transformers(moe_family):
    cfg = make_moe_config(moe_family)
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg, hf)
    ref_model = make_moe_hf_model(cfg, dtype=torch.float64, eager_experts=True)
    ids = torch.randint(0, VOCAB, (3, 13), generator=torch.Generator().manual_seed(1))
    for mask_kind in ("none", "right", "left"):
        mask = torch.ones_like(ids)
        if mask_kind == "right":
            mask[1, 9:] = 0
        elif mask_kind == "left":
            mask[2, :4] = 0
        with torch.no_grad():
            ref = ref_model(input_ids=ids, attention_mask=mask).logits
        ours = engine.logits(ids, mask)
        valid = mask.bool()
        close(ours[valid], ref[valid])


def test_decode_logits_match_transformers(moe_family):
    """Prefill prompts of different lengths, then decode fixed tokens (masked decode: one token
    per row, so each decode step routes B tokens through the grouped dispatch)."""
    cfg = make_moe_config(moe_family)
    engine = moe_engine(cfg, make_moe_hf_model(cfg))
    ref_model = make_moe_hf_model(cfg, dtype=torch.float64, eager_experts=True)
    lengths = [5, 11, 8]
    full = torch.randint(0, VOCAB, (3, 11 + 6), generator=torch.Generator().manual_seed(2))
    prompts = torch.zeros(3, 11, dtype=torch.long)
    for b, n in enumerate(lengths):
        prompts[b, :n] = full[b, :n]
    lens = torch.tensor(lengths)
    with torch.no_grad():
        ref_rows = [ref_model(full[b:b + 1, :n + 6]).logits[0] for b, n in enumerate(lengths)]
    logits = engine.runner.prefill(prompts, lens)
    for step in range(6):
        close(logits, torch.stack([ref_rows[b][n + step - 1] for b, n in enumerate(lengths)]))
        logits = engine.runner.decode(full[torch.arange(3), lens + step], lens + step, int(lens.max()) + step + 1)


def test_greedy_matches_transformers_generate(moe_family):
    cfg = make_moe_config(moe_family)
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg, hf)
    prompts = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32, 79]]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    for prompt, response in zip(prompts, out.response_token_ids):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0, eos_token_id=None)
        assert response == ref[0, len(prompt):].tolist()
    assert len(set(tuple(r) for r in out.response_token_ids)) == 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_match_trainer_recomputation(temperature):
    cfg = make_moe_config("qwen3_moe")
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg, hf)
    out = engine.generate([[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12]],
                          SamplingParams(temperature=temperature, max_tokens=10, seed=7))
    with torch.no_grad():
        logits = hf(input_ids=out.input_ids, attention_mask=out.attention_mask).logits.double()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits[:, :-1] / t, dim=-1).gather(-1, out.input_ids[:, 1:, None])[..., 0]
    expected = torch.zeros_like(out.logprobs, dtype=torch.float64)
    expected[:, 1:] = logp
    torch.testing.assert_close(out.logprobs.double(), expected * out.response_mask, rtol=0, atol=2e-4)


def test_bf16_close_to_float32():
    cfg = make_moe_config("qwen3_moe")
    hf = make_moe_hf_model(cfg)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    ref = moe_engine(cfg, hf).logits(ids, torch.ones_like(ids))
    ours = moe_engine(cfg, hf, dtype=torch.bfloat16).logits(ids, torch.ones_like(ids))
    # The RMS of the error, not its max: a router near-tie may pick another expert in
    # bf16 (a legitimate, kernel-dependent flip that moves a few logits by ~10% of the
    # largest), while rounding moves all of them by a few bf16 ulps (2^-8 relative each).
    # Measured under three ATen kernel sets on seeds 3-5: RMS ratio 0.010-0.025 (max
    # ratio up to 0.095, from a flip); 0.05 is ~13 bf16 ulps; a wrong weight or layout gives ~1.
    rms = lambda t: float(t.double().pow(2).mean().sqrt())  # noqa: E731
    assert rms(ours - ref) < 0.05 * rms(ref), rms(ours - ref) / rms(ref)


# ---- dispatch ----------------------------------------------------------------------------
def _naive_experts(x, w13, w2, ids, weights):
    """Token by token, expert by expert (float64): the definition."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, j]) * (w2[e].double() @ a)
    return out


@pytest.mark.parametrize("impl", ["grouped", "loop", "dense"])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_dispatch_implementations_match_definition(impl, T):
    g = torch.Generator().manual_seed(T)
    E, H, I, k = 8, 64, 32, 2
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    ids = torch.rand(T, E, generator=g).topk(k).indices
    if T == 40:
        ids[:, 0] = 3  # a hot expert, and experts with no token at all
        ids[:, 1] = torch.where(ids[:, 1] == 3, 5, ids[:, 1]).clamp(max=5)
    weights = torch.rand(T, k, generator=g)
    ours = fused_experts(x, w13, w2, ids, weights, impl)
    torch.testing.assert_close(ours.double(), _naive_experts(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


def test_grouped_and_dense_dispatch_have_static_shapes_and_no_host_reads():
    """On the meta device a kernel that read a value to the host (a routing-dependent shape, a
    sync) would raise: what a CUDA graph needs. The grouped path runs so in bf16 (torch's
    meta kernel mirrors the CUDA fast path); the dense fallback in any dtype."""
    E, H, I, k, T = 8, 64, 32, 2, 5
    for impl, dtype in (("grouped", torch.bfloat16), ("dense", torch.float32)):
        x = torch.empty(T, H, dtype=dtype, device="meta")
        w13, w2 = torch.empty(E, 2 * I, H, dtype=dtype, device="meta"), torch.empty(E, H, I, dtype=dtype, device="meta")
        ids = torch.empty(T, k, dtype=torch.long, device="meta")
        y = fused_experts(x, w13, w2, ids, torch.empty(T, k, dtype=dtype, device="meta"), impl)
        assert y.shape == (T, H) and y.device.type == "meta"


@pytest.mark.parametrize("impl", ["loop", "dense"])
def test_engine_logits_same_through_every_dispatch(impl, monkeypatch):
    cfg = make_moe_config("qwen2_moe")
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg, hf)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    ref = engine.logits(ids, torch.ones_like(ids))
    monkeypatch.setattr(moe_dispatch, "IMPL", impl)
    torch.testing.assert_close(engine.logits(ids, torch.ones_like(ids)), ref, rtol=1e-5, atol=1e-5)


# ---- routes and loading ------------------------------------------------------------------
def test_route_table_fused_names_and_per_expert_aliases(moe_family):
    cfg = make_moe_config(moe_family)
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg)
    routes = engine.weight_routes
    state = hf.state_dict()
    assert routes.expected == set(state) - routes.ignored  # named_parameters() names: the fused experts
    per_expert = dict(per_expert_state(hf))
    assert routes.aliases == set(per_expert) - set(state)
    for name, t in per_expert.items():
        if name in routes.ignored:
            continue
        assert name in routes and routes[name].shape == t.shape, name
        assert engine.weight_spec(name)[0] == t.shape
    # every element of an expert stack is covered exactly once by its aliases
    for fused, aliases in routes.alias_groups.items():
        count = torch.zeros(routes[fused].shape, dtype=torch.long)
        for a in aliases:
            r = routes[a]
            assert routes.canonical(a) == fused
            count[r.expert][r.layer.rows(r.proj, r.shard_id)] += 1
        assert bool((count == 1).all()), fused


def test_load_from_per_expert_names_equals_fused(moe_family):
    cfg = make_moe_config(moe_family)
    hf = make_moe_hf_model(cfg)
    fused, split = moe_engine(cfg, hf), moe_engine(cfg)
    split.load_weights(per_expert_state(hf))
    assert split.weight_version == 1
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    assert torch.equal(fused.logits(ids, torch.ones_like(ids)), split.logits(ids, torch.ones_like(ids)))


def test_from_pretrained_reads_per_expert_safetensors(tmp_path):
    """transformers saves experts per expert (``experts.{e}.gate_proj.weight``) on disk."""
    cfg = make_moe_config("qwen3_moe")
    hf = make_moe_hf_model(cfg)
    hf.save_pretrained(tmp_path)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in set(f.keys())
    engine = RolloutEngine.from_pretrained(str(tmp_path), max_batch_size=2, max_seq_len=32)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(6))
    close(engine.logits(ids, torch.ones_like(ids)), moe_engine(cfg, hf).logits(ids, torch.ones_like(ids)))


def test_incomplete_per_expert_update_names_the_fused_weight():
    cfg = make_moe_config("qwen3_moe")
    engine = moe_engine(cfg)
    pairs = [(n, t) for n, t in per_expert_state(make_moe_hf_model(cfg))
             if n != "model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(WeightUpdateError, match=r"1 weights never loaded: model\.layers\.2\.mlp\.experts\.gate_up_proj"):
        engine.load_weights(pairs)
    assert engine.weight_version == 0
    with pytest.raises(ValueError, match="expected"):
        engine.load_weights([("model.layers.0.mlp.experts.1.gate_proj.weight", torch.zeros(3, 64))])


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_refit_from_perturbed_model_verified(quantization):
    """Refit (fused names, as the trainer's named_parameters() yields them), verified: addresses
    kept, held values == what was sent; logits then follow the perturbed model."""
    cfg = make_moe_config("qwen2_moe")
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg, hf, quantization=quantization)
    ptrs = {n: t.data_ptr() for n, t in engine.named_state_tensors()}
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(7))
    before = engine.logits(ids, torch.ones_like(ids))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "experts" in name or "mlp.gate" in name:
                p.add_(0.05 * torch.randn_like(p))
    stats = refit_from_model(engine, hf, verify=True, bucket_bytes=1 << 14)
    assert stats.version == engine.weight_version == 2
    assert {n: t.data_ptr() for n, t in engine.named_state_tensors()} == ptrs
    after = engine.logits(ids, torch.ones_like(ids))
    assert not torch.allclose(after, before)
    if quantization is None:
        with torch.no_grad():
            close(after, hf(ids).logits)


def test_expected_held_equals_held_for_fused_and_per_expert_routes():
    cfg = make_moe_config("qwen3_moe")
    hf = make_moe_hf_model(cfg)
    for pairs in (list(hf.named_parameters()), per_expert_state(hf)):
        engine = moe_engine(cfg)
        expected = {n: engine.weight_routes[n].expected_held(t.detach()) for n, t in pairs if n in engine.weight_routes}
        engine.load_weights(pairs)
        for n, want in expected.items():
            assert torch.equal(engine.weight_routes[n].held(), want), n


def test_refit_from_per_expert_names():
    cfg = make_moe_config("qwen3_moe")
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg, hf)
    refit_from_model(engine, per_expert_state(make_moe_hf_model(cfg, seed=1)), verify=True)
    assert engine.weight_version == 2
