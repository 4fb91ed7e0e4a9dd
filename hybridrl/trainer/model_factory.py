"""Build the trainer's model and tokenizer: the built-in tiny Qwen2, or a local checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def builtin_tokenizer():
    from hybridrl.data.char_tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def builtin_model(tokenizer, *, hidden_size: int, num_hidden_layers: int, num_attention_heads: int,
                  num_key_value_heads: int, intermediate_size: int, max_position_embeddings: int = 128,
                  tie_word_embeddings: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random-init Qwen2 causal LM sized for the arithmetic task."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def load_pretrained(path: str, dtype: torch.dtype):
    """Model + tokenizer from a local HF checkpoint directory (never the hub)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"model.path={path}: no config.json there; point it at a local HF checkpoint directory")
    tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
