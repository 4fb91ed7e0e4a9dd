"""Fine-tune a small verifier for the default arithmetic task: an LLM judge that answers
"Yes" / "No" to ``Q: 37+45= A: 82 Correct?``, usable as ``{name: judge, path: OUT}``.

    python scripts/train_judge.py [--out runs/judge_arith] [--steps 3000] [--threads 1]

The model is the built-in Qwen2-architecture one (``hybridrl/job/model_factory.py``) over
the built-in character tokenizer extended by the characters of the judge's default
template and verdict words (the built-in alphabet, ``0-9 + - * = space``, cannot spell
"Q: ... Correct?"). Training prompts are the default task's (``data/arithmetic.py``: two
digits, "+", seed 0); half of the shown answers are right, half wrong — off by 1 to 3, or
the carry slip (37+45=72, the units carry forgotten). The loss is the cross-entropy of the
answer " Yes" / " No" + eos after the prompt rendered exactly as the judge renders it.

The checkpoint (model + tokenizer) goes to ``--out``; then the held-out split (prompts never
trained on) is scored through the judge reward itself (``parser=verdict``: P(Yes) /
(P(Yes) + P(No)) from one forward) and the accuracy of ``P(Yes) > 0.5`` is printed, per
kind of answer and overall, with one JSON line.

Measured (seed 0, 512 held-out answers): a few hundred steps stay at chance (600 steps,
verdict loss alone: 0.50; with the answer digits as targets: 0.54); the model has to
learn addition before it can check it. 1,500 steps of 2 layers: 0.72 (carry slips 0.19);
the defaults, 3,000 steps of 4 layers (4-6 steps/s on 1 thread of a shared 2-core machine:
500 s): 0.979 (right 0.996, off by 1-3 0.967, carry slip 0.944).
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridrl.data.arithmetic import Example, arithmetic_splits  # noqa: E402
from hybridrl.data.char_tokenizer import ARITHMETIC_CHARS, build_char_tokenizer  # noqa: E402
from hybridrl.rewards.judge_prompt import DEFAULT_TEMPLATE, JudgePrompt  # noqa: E402

VERDICTS = (" Yes", " No")  # the judge's words for a tokenizer without a chat template
KINDS = ("correct", "off_by_small", "carry_slip")


def judge_chars() -> str:
    """The built-in alphabet, then every other character of the default template's text and the verdicts."""
    text = "".join(lit for lit, *_ in string.Formatter().parse(DEFAULT_TEMPLATE)) + "".join(VERDICTS)
    extra = dict.fromkeys(ch for ch in text if ch not in ARITHMETIC_CHARS)
    return ARITHMETIC_CHARS + "".join(extra)


def shown_answer(ex: Example, kind: str, rng: random.Random) -> str:
    """The answer a judge sample shows: right, off by 1-3, or the carry slip."""
    right = int(ex.answer)
    if kind == "correct":
        return ex.answer
    if kind == "carry_slip":
        return ex.slip
    deltas = [d for d in (-3, -2, -1, 1, 2, 3) if right + d >= 0]
    return str(right + rng.choice(deltas))


def wrong_kind(ex: Example, rng: random.Random) -> str:
    """A wrong answer's kind: the carry slip (2 times in 3 when the problem carries: the policy's
    typical error, and the harder one to see) or a small offset."""
    return "carry_slip" if ex.slip is not None and rng.random() < 2 / 3 else "off_by_small"


def encode(prompt: JudgePrompt, tokenizer, ex: Example, kind: str, rng) -> tuple[list[int], list[int]]:
    """(token ids of prompt + verdict + eos, positions whose token is a target).

    Targets: the verdict and eos, and, when the shown answer is right, its digits too: a
    model that learns to write the sum where the answer goes has the sum at hand to compare
    against (measured: the verdict alone stays at chance for 600 steps)."""
    shown = shown_answer(ex, kind, rng)
    ids = prompt.token_ids(ex.prompt, shown, ex.answer)
    word = VERDICTS[0 if kind == "correct" else 1]
    answer = tokenizer.encode(word, add_special_tokens=False)[len(prompt.suffix):] + [tokenizer.eos_token_id]
    targets = list(range(len(ids), len(ids) + len(answer)))
    if kind == "correct":  # a character tokenizer: <bos> + one token per character of the text before it
        start = 1 + len(prompt.text(ex.prompt, "", ex.answer).split(" Correct?")[0])
        targets += range(start, start + len(shown))
    return ids + answer, targets


def batch_tensors(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids [B, S] and labels [B, S] (-100 except on the targets)."""
    S = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), S), pad, dtype=torch.long)
    labels = torch.full((len(rows), S), -100, dtype=torch.long)
    for r, (ids, targets) in enumerate(rows):
        input_ids[r, :len(ids)] = torch.tensor(ids)
        labels[r, targets] = torch.tensor(ids)[targets]
    return input_ids, labels


def _verdict_accuracy(logits: torch.Tensor, labels: torch.Tensor, verdict_ids: list[int]) -> float:
    """Share of the batch whose verdict logit (yes vs no) points the right way."""
    target = torch.zeros_like(labels, dtype=torch.bool)
    for v in verdict_ids:
        target |= labels == v
    rows, cols = target[:, 1:].nonzero(as_tuple=True)  # the logits at t - 1 predict the label at t
    pred = logits[rows, cols][:, verdict_ids].argmax(-1)
    truth = (labels[rows, cols + 1] == verdict_ids[1]).long()
    return float((pred == truth).float().mean())


def train(args) -> tuple[Path, list[Example]]:
    from hybridrl.config import ModelConfig
    from hybridrl.job.model_factory import builtin_model
    from hybridrl.job.progress import progress_bar

    tokenizer = build_char_tokenizer(judge_chars())
    suffix = tokenizer.encode(VERDICTS[0], add_special_tokens=False)[:1]  # the shared " " (judge_parse.verdict_tokens)
    prompt = JudgePrompt(tokenizer, DEFAULT_TEMPLATE, "", tuple(suffix))
    prompt.check_spelling("the judge tokenizer")
    train_set, eval_set = arithmetic_splits(num_digits=2, operations="+", train_size=20000, eval_size=args.eval_size,
                                            seed=0)
    spec = ModelConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=4 * args.hidden)
    model = builtin_model(tokenizer, spec, seed=args.seed, max_position_embeddings=64)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30) * max(0.05, 1 - s / args.steps))
    rng = random.Random(args.seed)
    verdict_ids = [tokenizer.encode(w, add_special_tokens=False)[len(suffix)] for w in VERDICTS]
    model.train()
    bar = progress_bar(range(args.steps), desc="train judge", total=args.steps)
    for _ in bar:
        exs = rng.sample(train_set, args.batch // 2)  # each problem shown right and wrong: only the answer differs
        rows = [encode(prompt, tokenizer, ex, kind, rng) for ex in exs for kind in ("correct", wrong_kind(ex, rng))]
        input_ids, labels = batch_tensors(rows, tokenizer.pad_token_id)
        out = model(input_ids=input_ids, labels=labels)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        verdict_acc = _verdict_accuracy(out.logits.detach(), labels, verdict_ids)
        bar.set_postfix(loss=f"{loss.item():.3f}", verdict_acc=f"{verdict_acc:.2f}")
    out = Path(args.out)
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, eval_set


def evaluate(path: Path, eval_set: list[Example], seed: int) -> dict:
    """Held-out accuracy of ``P(Yes) > 0.5`` through the judge reward, per kind and overall."""
    from hybridrl.rewards import RewardRunner

    rng = random.Random(seed + 1)
    rows = []
    for ex in eval_set:  # each held-out problem shown once right and once wrong
        wrong = wrong_kind(ex, rng)
        rows += [(ex, "correct", ex.answer), (ex, wrong, shown_answer(ex, wrong, rng))]
    t0 = time.perf_counter()
    with RewardRunner([{"name": "judge", "path": str(path), "parser": "verdict"}]) as runner:
        batch = runner.score([a for _, _, a in rows], [ex.answer for ex, _, _ in rows], [ex.prompt for ex, _, _ in rows])
    seconds = time.perf_counter() - t0
    assert not batch.failures, batch.failures
    hits = {k: [0, 0] for k in KINDS}
    for (_, kind, _), p in zip(rows, batch.scores):
        hits[kind][0] += (p > 0.5) == (kind == "correct")
        hits[kind][1] += 1
    result = {f"acc_{k}": round(h / n, 4) for k, (h, n) in hits.items() if n}
    result.update(accuracy=round(sum(h for h, _ in hits.values()) / len(rows), 4), samples=len(rows),
                  judge_seconds=round(seconds, 2))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/judge_arith")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: a tiny model runs fastest on one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    path, eval_set = train(args)
    result = evaluate(path, eval_set, args.seed)
    result.update(path=str(path), steps=args.steps, train_seconds=round(time.perf_counter() - t0, 1))
    print(f"held-out verdict accuracy {result['accuracy']:.3f} over {result['samples']} answers "
          f"(right {result.get('acc_correct', 0):.3f}, off by 1-3 {result.get('acc_off_by_small', 0):.3f}, "
          f"carry slip {result.get('acc_carry_slip', 0):.3f}); saved to {path}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
