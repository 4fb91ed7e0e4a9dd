import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridrl.trainer.value_model import ValueModel


def _config():
    return Qwen2Config(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, pad_token_id=0)


def _batch(gen):
    ids = torch.randint(1, 50, (3, 8), generator=gen)
    attn = torch.ones(3, 8, dtype=torch.long)
    attn[1, 6:] = 0
    attn[2, 4:] = 0
    return ids.masked_fill(attn == 0, 0), attn


def test_values_shape_alignment_and_padding():
    gen = torch.Generator().manual_seed(0)
    critic = ValueModel.from_config(_config(), seed=0).eval()
    ids, attn = _batch(gen)
    with torch.no_grad():
        v = critic.values(ids, attn)
    assert v.shape == (3, 8) and v.dtype == torch.float32
    assert not v[:, 0].any() and not v[attn == 0].any() and v[attn.bool()][3:].abs().sum() > 0
    # values[:, t] = V(ids[:, :t]): changing token t leaves values[:, :t+1] unchanged, changes values[:, t+1]
    ids2 = ids.clone()
    ids2[0, 4] = (ids[0, 4] % 49) + 1
    with torch.no_grad():
        v2 = critic.values(ids2, attn)
    torch.testing.assert_close(v2[0, :5], v[0, :5])
    assert (v2[0, 5] - v[0, 5]).abs() > 0
    # padding content never matters
    ids3 = ids.clone()
    ids3[attn == 0] = 7
    with torch.no_grad():
        torch.testing.assert_close(critic.values(ids3, attn), v)


def test_gradients_reach_head_and_backbone():
    gen = torch.Generator().manual_seed(1)
    critic = ValueModel.from_config(_config(), seed=0)
    ids, attn = _batch(gen)
    critic.values(ids, attn).square().sum().backward()
    assert critic.value_head.weight.grad.abs().sum() > 0
    assert critic.backbone.embed_tokens.weight.grad.abs().sum() > 0


def test_save_load_roundtrip_and_init_from_causal_lm(tmp_path):
    gen = torch.Generator().manual_seed(2)
    critic = ValueModel.from_config(_config(), seed=0).eval()
    ids, attn = _batch(gen)
    critic.save_pretrained(tmp_path / "critic")
    loaded = ValueModel.from_pretrained(tmp_path / "critic").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.values(ids, attn), critic.values(ids, attn))
    # the usual PPO start: a causal-LM checkpoint (the actor); its backbone weights are reused
    torch.manual_seed(3)
    lm = Qwen2ForCausalLM(_config())
    lm.save_pretrained(tmp_path / "actor")
    from_lm = ValueModel.from_pretrained(tmp_path / "actor")
    torch.testing.assert_close(from_lm.backbone.embed_tokens.weight, lm.model.embed_tokens.weight)
    torch.testing.assert_close(from_lm.backbone.layers[1].mlp.up_proj.weight, lm.model.layers[1].mlp.up_proj.weight)


def _value_batch(gen):
    """Rows of different response lengths, so the aggregation modes disagree."""
    ids, attn = _batch(gen)
    resp = torch.zeros(3, 8)
    resp[0, 3:8] = 1  # 5 response tokens
    resp[1, 4:6] = 1  # 2
    resp[2, 2:4] = 1  # 2
    returns = torch.randn(3, 8, generator=gen) * resp
    old = torch.randn(3, 8, generator=gen) * resp * 0.1
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp, "returns": returns, "values": old}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])
def test_critic_update_honours_loss_agg_mode(mode):
    """The critic's value loss is aggregated by the run's ``algo.loss_agg_mode``, by the
    formula: per-token ℓ = ½ max((V-R)², (clip(V)-R)²), then token-mean = Σℓ/ΣM,
    seq-mean-token-mean = mean_b(Σ_t ℓ/Σ_t M), seq-mean-token-sum = mean_b Σ_t ℓ,
    token-sum = Σℓ — recomputed here in float64 from the model's own predictions."""
    from hybridrl.config import OptimConfig, ValueConfig
    from hybridrl.trainer.critic import Critic

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    model = ValueModel.from_config(_config(), seed=0)
    critic = Critic(model, optim=OptimConfig(critic_lr=1e-3), value=ValueConfig(cliprange=0.05), loss_agg_mode=mode)
    batch = _value_batch(gen)
    with torch.no_grad():
        v = model.values(batch["input_ids"], batch["attention_mask"]).double()
    m, R, old = batch["response_mask"].double(), batch["returns"].double(), batch["values"].double()
    clipped = torch.minimum(torch.maximum(v, old - 0.05), old + 0.05)
    per_token = 0.5 * torch.maximum((v - R) ** 2, (clipped - R) ** 2) * m
    want = {"token-mean": per_token.sum() / m.sum(),
            "seq-mean-token-mean": (per_token.sum(-1) / m.sum(-1)).mean(),
            "seq-mean-token-sum": per_token.sum(-1).mean(),
            "token-sum": per_token.sum()}[mode]
    got = critic.update(batch)["critic/vf_loss"]
    assert abs(got - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
