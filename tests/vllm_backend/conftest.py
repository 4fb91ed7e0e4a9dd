"""Fixtures of the vLLM backend tests: one tiny Qwen2 checkpoint (char tokenizer, random
init, saved like a run's checkpoint) and one in-process vLLM engine per test module
(closed after it: vLLM holds a torch.distributed group while it lives).

vLLM is an optional extra; without it every engine test is skipped (see
``_vllm_helpers.SKIP_NO_VLLM``); ``make test`` installs it, so CI runs them for real on CPU.
"""

from __future__ import annotations

import pytest
from _vllm_helpers import MAX_BATCH, MAX_SEQ


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """(checkpoint dir, tokenizer, HF model): the built-in tiny Qwen2 (tied embeddings;
    head_dim 32, the smallest vLLM's CPU attention supports)."""
    from hybridrl.data.char_tokenizer import build_char_tokenizer
    from hybridrl.checkpoint.atomic import save_checkpoint_atomic
    from hybridrl.job.model_factory import builtin_model
    from hybridrl.config import ModelConfig

    tok = build_char_tokenizer()
    model = builtin_model(tok, ModelConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, tie_word_embeddings=True), max_position_embeddings=64, seed=3).eval()
    ckpt = save_checkpoint_atomic(model, tok, tmp_path_factory.mktemp("vllm") / "init")
    return str(ckpt), tok, model


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    """One in-process VllmEngine per module (building one costs ~10 s), loaded from
    the checkpoint (weight_version 1). Tests refit it to the weights they need."""
    from hybridrl.vllm_backend import VllmEngine

    ckpt, _, _ = tiny_checkpoint
    eng = VllmEngine.from_pretrained(ckpt, max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ)
    yield eng
    eng.close()
