"""Reward-model scoring throughput: ``reward_model`` vs a plain transformers loop.

Both score the same RL-shaped batch (unique (prompt, response) pairs whose responses run
from a few tokens to hundreds, in the order a rollout returns them) with the same
``Qwen2ForSequenceClassification`` checkpoint (random init from a config: nothing is
downloaded) through its chat template, in float32 on CPU, and produce the same scores
(checked). The baseline is what a competent TRL user writes: ``apply_chat_template``, the
tokenizer pads a fixed batch (right side, the default), ``torch.inference_mode()``, the
model's own pooling. Ours sorts rows by length into token-budgeted micro-batches with the
same peak padded size as the baseline's longest batch, and runs the head at one position.
Metric: real (unpadded) tokens scored per second, best of interleaved rounds.
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common

from _common import best_interleaved  # noqa: E402

CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
SPECIALS = ("<|im_start|>", "<|im_end|>")
TEMPLATE = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
            "{%- endfor %}")
BASELINE_BATCH = 8


def _checkpoint(directory: Path, hidden: int, layers: int) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from hybridrl.data.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(CHARS, specials=SPECIALS, chat_template=TEMPLATE, eos_token="<|im_end|>")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=4 * hidden, num_labels=1,
                         pad_token_id=tok.pad_token_id, max_position_embeddings=2048)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def _texts(n: int, longest: int) -> tuple[list[str], list[str]]:
    """Prompts of 20-60 characters; responses mostly short with a long tail (up to ``longest``)."""
    rng = random.Random(0)
    words = ["the", "sum", "is", "so", "we", "carry", "one", "then", "add", "tens", "answer", "check"]

    def text(k: int) -> str:
        out = ""
        while len(out) < k:
            out += rng.choice(words) + rng.choice([" ", " ", ", ", ". ", "\n"]) + str(rng.randrange(100))
        return out[:k]

    prompts = [text(rng.randint(20, 60)) + "?" for _ in range(n)]
    responses = [text(min(longest, int(rng.paretovariate(1.2) * 12))) + f" #{i}" for i in range(n)]
    return prompts, responses


def _baseline(path: str):
    """Score like a TRL user: fixed batches in the given order, padded by the tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()

    def score(prompts: list[str], responses: list[str]) -> list[float]:
        texts = [tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": r}],
                                         tokenize=False) for p, r in zip(prompts, responses)]
        out: list[float] = []
        with torch.inference_mode():
            for i in range(0, len(texts), BASELINE_BATCH):
                enc = tok(texts[i:i + BASELINE_BATCH], padding=True, add_special_tokens=False, return_tensors="pt")
                out += model(**enc).logits[:, 0].float().tolist()
        return out

    return score


def rows(quick: bool) -> list[dict]:
    import torch
    import transformers

    from hybridrl.rewards.reward_model import RewardModel
    from hybridrl.rewards.sequence_scorer import render

    n, longest, hidden, layers, repeats = (32, 192, 128, 2, 2) if quick else (256, 1024, 256, 4, 3)
    with tempfile.TemporaryDirectory() as tmp:
        path = _checkpoint(Path(tmp), hidden, layers)
        prompts, responses = _texts(n, longest)
        ours_rm = RewardModel(path=path, max_tokens_per_microbatch=BASELINE_BATCH * (longest + 80))
        baseline = _baseline(path)
        ours_scores, base_scores = ours_rm(responses, [None] * n, prompts), baseline(prompts, responses)  # warm-up
        worst = max(abs(a - b) for a, b in zip(ours_scores, base_scores))
        assert worst < 1e-4, f"reward_model and the transformers loop disagree by {worst:.3g}"
        tokens = sum(len(render(ours_rm._scorer.tokenizer, p, r)) for p, r in zip(prompts, responses))
        t_ours, t_base = best_interleaved([lambda: ours_rm(responses, [None] * n, prompts),
                                            lambda: baseline(prompts, responses)], repeats)
    name = (f"transformers {transformers.__version__} AutoModelForSequenceClassification, batch {BASELINE_BATCH} "
            f"in rollout order, tokenizer-padded (right), inference_mode, fp32, torch {torch.__version__.split('+')[0]}")
    return [{"case": f"reward model {hidden}x{layers} Qwen2, {n} rows, {tokens} tokens", "metric": "tokens/s",
             "ours": tokens / t_ours, "baseline": tokens / t_base, "baseline_name": name, "higher_is_better": True}]


if __name__ == "__main__":
    for r in rows(quick="--quick" in sys.argv):
        print(r)
