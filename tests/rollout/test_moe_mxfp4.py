"""MXFP4 experts in the engine: numerics vs transformers with the same quantized experts, the
dequantized derived cache across refits (the background reports' bug), order, verification,
mixed FP8 + MXFP4."""

import pytest
import torch

from hybridrl.quant import mxfp4
from hybridrl.refit import RefitError, refit_from_model
from hybridrl.rollout import EngineSpec, RolloutEngine, SamplingParams
from hybridrl.rollout.derived import DerivedCacheError
from hybridrl.rollout.layers.fused_moe import FusedExperts
from hybridrl.rollout.layers.quantization import get_linear_method
from tests.rollout.conftest import VOCAB
from tests.rollout.test_moe import close, make_moe_config, make_moe_hf_model, moe_engine, per_expert_state


def experts_of(engine) -> list[FusedExperts]:
    return [m for m in engine.model.modules() if isinstance(m, FusedExperts)]


def mxfp4_rounded(hf):
    """``hf`` with every expert weight replaced by ``dequant(quant(w))``: what an MXFP4 engine computes with."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".experts." in name:
                p.copy_(mxfp4.dequantize(*mxfp4.quantize(p)))
    return hf


def perturb_experts(hf, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".experts." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_mxfp4_engine_matches_transformers_with_the_same_quantized_experts(family):
    cfg = make_moe_config(family)
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg, hf, quantization="mxfp4")
    ref = mxfp4_rounded(make_moe_hf_model(cfg))
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        close(engine.logits(ids, torch.ones_like(ids)), ref(ids).logits)
    prompts = [[3, 14, 15, 92, 65], [35, 89]]
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    for prompt, response in zip(prompts, out.response_token_ids):
        want = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0, eos_token_id=None)
        assert response == want[0, len(prompt):].tolist()
    # and MXFP4 is really in play: the unquantized model gives other logits
    with torch.no_grad():
        assert (engine.logits(ids, torch.ones_like(ids)) - hf(ids).logits).abs().max() > 1e-2


def test_held_weights_within_the_mxfp4_error_bound():
    cfg = make_moe_config("qwen3_moe")
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg, hf, quantization="mxfp4")
    for name, p in hf.named_parameters():
        if ".experts." in name:
            held = engine.weight_routes[name].held()
            _, scales = mxfp4.quantize(p.detach())
            assert ((held - p.detach()).abs() <= mxfp4.abs_error_bound(p.detach(), scales)).all(), name


def test_quantization_names_pick_dense_and_expert_methods():
    cfg = make_moe_config("qwen3_moe")
    m = moe_engine(cfg, quantization="mxfp4").model.model.layers[0]
    assert m.self_attn.qkv_proj.weight.dtype == torch.float32  # dense linears unquantized
    assert m.mlp.gate.weight.dtype == torch.float32  # the router is never quantized
    assert m.mlp.experts.gate_up_proj_blocks.dtype == torch.uint8
    m = moe_engine(cfg, quantization="fp8+mxfp4").model.model.layers[0]
    assert m.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn and m.mlp.gate.weight.dtype == torch.float32
    assert m.mlp.experts.down_proj_scales.dtype == torch.uint8
    m = moe_engine(cfg, quantization="fp8").model.model.layers[0]
    assert m.mlp.experts.gate_up_proj.dtype == torch.float32  # experts: MXFP4 only when asked
    with pytest.raises(ValueError, match="not supported"):
        get_linear_method("fp4")
    with pytest.raises(ValueError, match="multiple of 32"):
        moe_engine(make_moe_config("qwen3_moe", moe_intermediate_size=24), quantization="mxfp4")


def test_derived_cache_refreshed_in_place_after_each_of_three_refits():
    """The background reports' bug: after the quantized expert weights are restored, the
    dequantized copy the kernels read must be recomputed — in place (a captured graph holds
    its address). After every refit each cache must equal a fresh dequantization bit for
    bit, follow the new weights (not the previous step's: stale = the bug) and keep its address."""
    cfg = make_moe_config("qwen3_moe")
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg, hf, quantization="mxfp4")
    caches = dict(engine.named_derived_caches())
    assert len(caches) == 2 * len(experts_of(engine))
    ptrs = {n: c.tensor.data_ptr() for n, c in caches.items()}
    previous = {n: c.tensor.clone() for n, c in caches.items()}
    for step in range(3):
        perturb_experts(hf, seed=step)
        refit_from_model(engine, hf, verify=True)
        state = dict(hf.named_parameters())
        for name, cache in caches.items():
            layer, proj = cache.module, cache.attr[:-len("_dequant")]
            assert cache.tensor.data_ptr() == ptrs[name]
            fresh = mxfp4.dequantize(getattr(layer, f"{proj}_blocks"), getattr(layer, f"{proj}_scales"), cache.tensor.dtype)
            assert torch.equal(cache.tensor, fresh), name
            sent = state[name[:-len("_dequant")]].detach()
            assert torch.equal(cache.tensor, mxfp4.dequantize(*mxfp4.quantize(sent))), name  # the new weights
            assert not torch.equal(cache.tensor, previous[name]), name  # not the previous step's
            previous[name] = cache.tensor.clone()
    assert engine.weight_version == 4


def test_refresh_before_restore_raises_and_loader_refuses_writes_outside_an_update():
    cfg = make_moe_config("qwen3_moe")
    engine = moe_engine(cfg, make_moe_hf_model(cfg), quantization="mxfp4")
    _, cache = next(iter(engine.named_derived_caches()))
    engine.begin_weight_update()  # experts back in loading layout
    with pytest.raises(DerivedCacheError, match="not in inference layout"):
        cache.refresh()
    engine.abort_weight_update()
    cache.refresh()  # fine once the layout is restored
    route = engine.weight_routes["model.layers.0.mlp.experts.gate_up_proj"]
    with pytest.raises(ValueError, match="outside a weight update"):
        route.load(torch.zeros(route.shape))


def test_verifier_catches_a_stale_mxfp4_cache(monkeypatch):
    """A cache that finish() skipped (the bug) fails refit verification; nothing is committed."""
    cfg = make_moe_config("qwen3_moe")
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg, hf, quantization="mxfp4")
    name, cache = next(iter(engine.named_derived_caches()))
    monkeypatch.setattr(cache, "refresh", lambda: None)
    perturb_experts(hf, seed=9)
    with pytest.raises(RefitError, match="stale derived caches"):
        refit_from_model(engine, hf, verify=True)
    assert engine.weight_version == 1


@pytest.mark.parametrize("quantization", ["mxfp4", "fp8+mxfp4"])
def test_refit_verifier_passes_with_mxfp4(quantization):
    """One refit writes FP8 dense linears and MXFP4 experts; the verifier checks addresses,
    every derived cache (FP8 and MXFP4) and exact checksums of what each route holds."""
    cfg = make_moe_config("qwen2_moe")
    hf = make_moe_hf_model(cfg)
    engine = moe_engine(cfg, hf, quantization=quantization)
    for step in range(2):
        perturb_experts(hf, seed=step)
        stats = refit_from_model(engine, hf, verify=True, bucket_bytes=1 << 15)
    assert stats.version == 3
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    rounded = mxfp4_rounded(hf)
    ours = engine.logits(ids, torch.ones_like(ids))
    if quantization == "mxfp4":
        with torch.no_grad():
            close(ours, rounded(ids).logits)
    else:  # == an FP8 engine (experts unquantized) given the MXFP4-rounded experts
        ref = moe_engine(cfg, rounded, quantization="fp8").logits(ids, torch.ones_like(ids))
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_per_expert_load_writes_the_same_bits_as_fused():
    cfg = make_moe_config("qwen3_moe")
    hf = make_moe_hf_model(cfg)
    fused = moe_engine(cfg, hf, quantization="mxfp4")
    split = RolloutEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=32, quantization="mxfp4"))
    split.load_weights(per_expert_state(hf))
    for a, b in zip(experts_of(fused), experts_of(split)):
        for t in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_dequant"):
            assert torch.equal(getattr(a, t), getattr(b, t)), t
