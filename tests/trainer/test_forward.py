"""compute_logprobs_entropy: packed backends and chunked lm_head equal the padded
full-logits reference, values and gradients."""

import pytest
import torch
import transformers

from hybridrl.attention import varlen
from hybridrl.trainer.forward import ForwardOptions, chunked_logprobs_entropy, compute_logprobs_entropy


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    return transformers.Qwen2ForCausalLM(cfg)


def batch(seed, rows=5, width=20, vocab=97):
    """Right-padded prompt+response rows of random lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, width + 1, (rows,), generator=g)
    prompt = torch.randint(1, 6, (rows,), generator=g)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    pos = torch.arange(width)[None]
    mask = (pos < lengths[:, None]).long()
    response = ((pos >= prompt[:, None]) & (pos < lengths[:, None])).float()
    return ids, mask, response


def reference(model, ids, mask, response, temperature):
    """Plain padded forward, full float32 logits."""
    logq = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float() / temperature, -1)
    lp = torch.zeros(ids.shape)
    ent = torch.zeros(ids.shape)
    lp[:, 1:] = logq[:, :-1].gather(2, ids[:, 1:, None]).squeeze(2)
    ent[:, 1:] = -(logq.exp() * logq).sum(-1)[:, :-1]
    keep = response.clone()
    keep[:, 0] = 0
    return lp * keep, ent * keep


@pytest.mark.parametrize("backend", ["varlen", "bucketed", "block_diagonal"])
@pytest.mark.parametrize("seed", [0])
def test_packed_equals_padded_with_grads(model, backend, seed, monkeypatch):
    monkeypatch.setattr(varlen, "USE_FLASH_ATTN", False)
    ids, mask, response = batch(seed)
    ref_lp, ref_ent = reference(model, ids, mask, response, 0.8)
    params = list(model.parameters())
    w_lp, w_ent = torch.randn(ids.shape), torch.randn(ids.shape)  # arbitrary upstream grads
    ref_g = torch.autograd.grad((ref_lp * w_lp + ref_ent * w_ent).sum(), params)
    lp, ent = compute_logprobs_entropy(
        model, ids, mask, response, options=ForwardOptions(
            temperature=0.8, attn_backend=backend, vocab_chunk_tokens=7, max_tokens_per_microbatch=40),
    )
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ids.shape
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=2e-5)
    grads = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), params)
    for g, r in zip(grads, ref_g):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_no_grad_and_unpacked_and_model_attention_restored(model):
    ids, mask, response = batch(3)
    with torch.no_grad():
        lp, ent = compute_logprobs_entropy(model, ids, mask, response,
                                           options=ForwardOptions(packed=False, compute_entropy=False))
        plp, _ = compute_logprobs_entropy(model, ids, mask, response)
    torch.testing.assert_close(plp, lp, rtol=1e-5, atol=2e-5)
    assert not lp.requires_grad and torch.count_nonzero(ent) == 0
    assert model.config._attn_implementation == "sdpa"


def test_chunked_lm_head_float64_grads():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=True).double()
    h = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (13,))

    assert torch.autograd.gradcheck(
        lambda h, w, b: chunked_logprobs_entropy(h, _Head(w, b), t, temperature=1.3, chunk_tokens=4),
        (h, head.weight.detach().clone().requires_grad_(), head.bias.detach().clone().requires_grad_()),
    )


class _Head:
    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias


def test_shape_mismatch_is_valueerror(model):
    ids, mask, response = batch(0)
    with pytest.raises(ValueError, match="must share shape"):
        compute_logprobs_entropy(model, ids, mask[:, :-1], response)
