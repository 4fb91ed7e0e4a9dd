"""The ``judge`` reward on the vLLM backend (``backend: vllm``, the number parser): its
greedy answers equal the built-in engine's judge on the same checkpoint (up to a near-tie,
``tests/_greedy.py``), served through the same server thread. Kept apart from
``tests/rewards/test_judge.py`` because starting vLLM costs ~20 s on a CPU."""

from __future__ import annotations

import random

import pytest
import torch

from _seeds import fresh_seed
from hybridrl.rewards.judge import JudgeOptions, LLMJudge
from tests._greedy import rounding_margin
from tests.rewards.judge_models import char_tokenizer
from tests.vllm_backend._vllm_helpers import SKIP_NO_VLLM

pytestmark = [SKIP_NO_VLLM, pytest.mark.slow]


def _judge_dir(path, seed: int):
    """A random Qwen2 judge with head_dim 32 (vLLM's CPU attention refuses 16)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else
                    torch.randn_like(p) * (0.5 if "embed" in name else 0.12))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model.eval()


def test_vllm_judge_answers_equal_the_builtin_judge(tmp_path):
    seed = fresh_seed()
    rng = random.Random(seed)
    path, hf = _judge_dir(tmp_path / "j", seed)
    common = dict(path=str(path), parser="number", max_tokens=8, device="cpu", max_batch_size=4, max_seq_len=64)
    ours, theirs = LLMJudge(JudgeOptions(**common)), LLMJudge(JudgeOptions(backend="vllm", **common))
    try:
        draws = [(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=", str(rng.randint(0, 198))) for _ in range(6)]
        prompts = [ours.prompt.token_ids(q, r, "") for q, r in draws]
        got = [theirs.server.result(t) for t in [theirs.server.submit(p, 600) for p in prompts]]
        want = [ours.server.result(t) for t in [ours.server.submit(p, 600) for p in prompts]]
        assert theirs.server.parent is not None  # the shared prefix went in as a retained request
        for p, a, b in zip(prompts, got, want):
            if a == b:
                continue
            i = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
            with torch.no_grad():
                logits = hf(torch.tensor([p + b[:i]])).logits[0, -1]
            gap = abs(float(logits[a[i]] - logits[b[i]]))
            assert gap < rounding_margin(logits), f"seed {seed}: vllm {a} != builtin {b} (logit gap {gap:.3g})"
    finally:
        ours.close()
        theirs.close()
