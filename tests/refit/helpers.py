"""Small models and checks shared by the refit tests (random init from configs, no downloads)."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hybridrl.rollout import EngineSpec, RolloutEngine

VOCAB = 256


def qwen2_config(**kw):
    """Tied embeddings, q/k/v bias; shard sizes multiples of 128 so fp8_block applies."""
    base = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=True)
    return Qwen2Config(**{**base, **kw})


def llama_config(**kw):
    """Untied head, odd-ish sizes (per-channel FP8 only)."""
    base = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=False)
    return LlamaConfig(**{**base, **kw})


def hf_model(cfg, seed: int = 0):
    """A float64 transformers reference model with random weights."""
    torch.manual_seed(seed)
    cls = Qwen2ForCausalLM if cfg.model_type == "qwen2" else LlamaForCausalLM
    return cls(cfg).double().eval()


def perturb(model, seed: int, scale: float = 0.05) -> None:
    """A random 'optimizer step': every parameter moves, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def engine(cfg, quantization=None, dtype=torch.float32):
    return RolloutEngine(cfg, EngineSpec(max_batch_size=2, max_seq_len=32, dtype=dtype, quantization=quantization))


def inputs(seed: int = 0, batch: int = 2, seq: int = 12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return ids, torch.ones_like(ids)


def ref_logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def clone_state(eng) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in eng.named_state_tensors()}


def assert_state_equal(eng, before: dict[str, torch.Tensor]) -> None:
    now = dict(eng.named_state_tensors())
    assert now.keys() == before.keys()
    for n, t in before.items():
        a, b = now[n], t
        if a.dtype.is_floating_point and a.element_size() == 1:  # fp8: compare bits
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), f"{n} changed"


# fp32 engine vs a float64 reference: rounding grows with the logits' magnitude, so the
# bound is in ulps of the largest reference logit, not an absolute constant tuned on one
# machine (measured under three ATen kernel sets: <= 6e-6 at max |logit| 3-5.6, ~8 ulps).
FP32_ULPS = 64


def assert_fp32_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """``got`` (fp32 engine logits) equals ``ref`` (float64) within FP32_ULPS ulps of max |ref|."""
    atol = FP32_ULPS * torch.finfo(torch.float32).eps * float(ref.abs().max())
    torch.testing.assert_close(got.double(), ref, atol=atol, rtol=0)
