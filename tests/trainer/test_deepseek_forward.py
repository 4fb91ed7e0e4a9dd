"""The trainer's log-prob pass on transformers' DeepseekV3ForCausalLM vs the engine's
sampling log-probs (fp32, 1e-5): every packed attention backend (MLA: q/k head dim != v head
dim), chunked lm_head, routing replay; the DeepSeek balance loss by hand."""
import pytest
import torch

from hybridrl.attention import varlen
from hybridrl.rollout import SamplingParams
from hybridrl.trainer.balance_loss import router_load_balancing_loss, sigmoid_balance_loss
from hybridrl.trainer.forward import ForwardOptions, MoEForward, compute_logprobs_entropy
from tests.rollout import _deepseek as ds


@pytest.fixture(scope="module")
def sampled():
    cfg = ds.config()
    hf = ds.hf_model(cfg, seed=21)
    eng = ds.engine(cfg, hf, record_routing=True)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),)).tolist() for n in torch.randint(3, 14, (6,))]
    out = eng.generate(prompts, SamplingParams(max_tokens=10, temperature=1.0, seed=5))
    return hf, out


@pytest.mark.parametrize("backend", ["varlen", "bucketed", "block_diagonal"])
@pytest.mark.parametrize("replay", [False, True])
def test_trainer_logprobs_equal_engine_logprobs(sampled, backend, replay, monkeypatch):
    monkeypatch.setattr(varlen, "USE_FLASH_ATTN", False)
    hf, out = sampled
    moe = MoEForward(routed_experts=out.routed_experts) if replay else None
    with torch.no_grad():
        lp, _ = compute_logprobs_entropy(
            hf, out.input_ids, out.attention_mask, out.response_mask, moe=moe,
            options=ForwardOptions(attn_backend=backend, vocab_chunk_tokens=7, max_tokens_per_microbatch=48))
    m = out.response_mask.bool()
    m[:, 0] = False
    err = (lp[m] - out.logprobs[m]).abs().max().item()
    assert err < 1e-5, f"{backend}, replay={replay}: {err:.2e}"


def test_sigmoid_balance_loss_by_hand():
    cfg = ds.config(n_group=1, topk_group=1)  # plain top-k of the biased scores
    hf = ds.hf_model(cfg, seed=22)
    logits = tuple(torch.randn(50, cfg.n_routed_experts, dtype=torch.float64).float()
                   for _ in range(cfg.num_hidden_layers - cfg.first_k_dense_replace))
    routers = [layer.mlp.gate for layer in hf.model.layers[cfg.first_k_dense_replace:]]
    want = 0.0
    for router, lg in zip(routers, logits):
        s = lg.double().sigmoid()
        chosen = (s + router.e_score_correction_bias.double()).topk(cfg.num_experts_per_tok, dim=-1).indices
        E, T, k = cfg.n_routed_experts, lg.shape[0], cfg.num_experts_per_tok
        f = [E / (k * T) * float((chosen == i).sum()) for i in range(E)]  # DeepSeek-V3 eq. 18
        p = (s / s.sum(-1, keepdim=True)).mean(0)  # eq. 19-20
        want += sum(fi * float(pi) for fi, pi in zip(f, p))
    want /= len(logits)
    got = sigmoid_balance_loss(hf, logits)
    assert abs(float(got) - want) < 1e-5


def test_deepseek_v4_trainer_logprobs_equal_engine_logprobs_and_packing_is_refused():
    """V4 cannot run packed (its compressors cut windows from each row's start): 'auto' picks
    right-aligned buckets, exact, with and without the engine's routing replayed; the aux loss
    is transformers' V4 loss over the real tokens' top-k router logits; asking for varlen is one line."""
    import random

    from hybridrl.refit.transport import named_trainer_tensors
    from hybridrl.rollout import EngineSpec, RolloutEngine
    from tests.rollout._deepseek_v4 import drawn, reference

    cfg, hf = drawn(31)
    eng = RolloutEngine(cfg, EngineSpec(max_batch_size=4, max_seq_len=96, dtype=torch.float32), record_routing=True)
    eng.load_weights(named_trainer_tensors(hf))
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in random.Random(0).sample(range(5, 40), 4)]
    out = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=2))
    m = out.response_mask.bool()
    m[:, 0] = False
    for moe in (None, MoEForward(routed_experts=out.routed_experts, router_logits=[])):
        with torch.no_grad():
            lp, _ = compute_logprobs_entropy(hf, out.input_ids, out.attention_mask, out.response_mask,
                                             options=ForwardOptions(vocab_chunk_tokens=7), moe=moe)
        assert (lp[m] - out.logprobs[m]).abs().max() < 1e-4
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import load_balancing_loss_func

    rows = []  # transformers' router logits of each row's real tokens, alone
    with torch.no_grad():
        for b in range(len(prompts)):
            ids = out.input_ids[b][out.attention_mask[b].bool()]
            rows.append(reference(hf, input_ids=ids[None], output_router_logits=True).router_logits)
    want = load_balancing_loss_func(tuple(torch.cat(layer) for layer in zip(*rows)), cfg.n_routed_experts,
                                    cfg.num_experts_per_tok)
    assert len(moe.router_logits[0]) == cfg.mlp_layer_types.count("moe")
    torch.testing.assert_close(router_load_balancing_loss(hf, moe.router_logits), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="attn_backend='varlen' is wrong for deepseek_v4") as err:
        compute_logprobs_entropy(hf, out.input_ids, out.attention_mask, out.response_mask,
                                 options=ForwardOptions(attn_backend="varlen"))
    assert "\n" not in str(err.value)
