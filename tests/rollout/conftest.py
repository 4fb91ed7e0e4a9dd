"""Small random-init models of each supported family (no downloads)."""

import pytest
import torch
import transformers

VOCAB = 101


def make_config(family: str, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16})
    elif family == "llama_linear":
        cfg = transformers.LlamaConfig(**common, rope_scaling={"rope_type": "linear", "factor": 2.0},
                                       attention_bias=True)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=24)  # head_dim != hidden / heads
    else:
        raise KeyError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_hf_model(cfg, seed: int = 0, dtype=torch.float32, **from_config):
    """HF model with weights large enough that logits are far from uniform (std 0.02 init
    makes greedy decoding degenerate and would hide bugs)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, **from_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 if "embed" in name else 0.12))
    return model.to(dtype).eval()


FAMILIES = ["llama", "llama_linear", "qwen2", "qwen3"]


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one intra-op thread is faster, and avoids the OpenMP
    barrier stalls that make multi-threaded tiny matmuls ~50x slower on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
