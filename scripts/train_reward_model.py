"""Train a small reward model for the built-in arithmetic task, loadable by ``reward_model``.

    .venv/bin/python scripts/train_reward_model.py --out runs/rm_arith

A Qwen2-architecture ``Qwen2ForSequenceClassification`` (one label) on the built-in
character tokenizer, the one the default policy uses, saved with it, so that
``{name: reward_model, path: runs/rm_arith}`` scores the default job's responses. Each
step draws training prompts (``37+45=``, the default job's split and seed) and pairs the
correct answer (chosen) with a wrong one (rejected): off by a little, off by ten, off by
nine (the same digit sum), the forgotten units carry (the default warm start's systematic
error), digits swapped, dropped or added, an operand echoed, any other number, empty,
garbage, or too long. Loss: Bradley-Terry, ``-log sigmoid(s_chosen - s_rejected)``, plus TRL's
``center_rewards_coefficient * (s_c + s_r)^2`` so that scores sit near zero across prompts
(a critic sees absolute values), plus an auxiliary next-token loss on the correct answers.

At the end it reloads the saved directory through ``hybridrl.rewards.reward_model`` (the
path a training run takes) and prints, on held-out prompts and on as many training prompts
(the ones a PPO run on this task scores): pairwise accuracy per kind of
wrong answer, the share of prompts whose correct answer outranks every wrong kind at once,
the mean score of correct and of incorrect answers, and how often the correct answer
scores above every string of at most three digits.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from hybridrl.data.arithmetic import arithmetic_splits
from hybridrl.data.char_tokenizer import ARITHMETIC_CHARS
from hybridrl.job.model_factory import builtin_tokenizer
from hybridrl.rewards.reward_model import RewardModel
from hybridrl.rewards.sequence_scorer import plan_microbatches, render

EXHAUSTIVE_PROMPTS = 64  # held-out prompts checked against every string of <= 3 digits
MAX_RESPONSE = 16  # longest wrong answer drawn ("too long"): 2x the default rollout.max_tokens of 8

# (kind, weight): near misses dominate, they are what a learning policy produces
KINDS = (("near", 0.18), ("tens", 0.07), ("slip", 0.15), ("nines", 0.08), ("swap", 0.04), ("drop", 0.05),
         ("extra", 0.07), ("operand", 0.04), ("number", 0.12), ("empty", 0.03), ("garbage", 0.07), ("long", 0.10))


def wrong_answer(rng: random.Random, kind: str, a: int, b: int) -> str:
    """One incorrect response of ``kind`` for ``a+b=`` (never the correct answer)."""
    c = a + b
    s = str(c)
    if kind == "near":
        out = str(max(0, c + rng.choice([-3, -2, -1, 1, 2, 3])))
    elif kind == "tens":
        out = str(abs(c + rng.choice([-20, -10, 10, 20, 100])))
    elif kind == "slip":  # the units carry forgotten, else a near miss
        out = str(c - 10) if a % 10 + b % 10 >= 10 else str(c + rng.choice([-1, 1]))
    elif kind == "swap":
        out = s[::-1] if len(s) > 1 else s + s
    elif kind == "drop":
        i = rng.randrange(len(s))
        out = s[:i] + s[i + 1:] if len(s) > 1 else ""
    elif kind == "extra":
        d = str(rng.randrange(10))
        out = s + d if rng.random() < 0.5 else d + s
    elif kind == "operand":
        out = rng.choice([str(a), str(b), f"{a}+{b}", f"{a}{b}"])
    elif kind == "empty":
        out = rng.choice(["", " ", "="])
    elif kind == "nines":  # the same digit sum: a model that checks a checksum of the digits confuses them
        out = str(abs(c + rng.choice([-18, -9, 9, 18, 90, -90, 99])))
    elif kind == "number":  # any string of 1-3 digits, leading zeros included
        k = rng.randint(1, 3)
        out = f"{rng.randrange(10 ** k):0{k}d}"
    elif kind == "garbage":
        out = "".join(rng.choice(ARITHMETIC_CHARS) for _ in range(rng.randint(1, MAX_RESPONSE)))
    else:  # long: the answer followed (or preceded) by more
        tail = "".join(rng.choice(ARITHMETIC_CHARS) for _ in range(rng.randint(1, MAX_RESPONSE - len(s))))
        out = rng.choice([s + tail, tail + s, (s * MAX_RESPONSE)[:rng.randint(len(s) + 1, MAX_RESPONSE)]])
    return out if out.strip() != s else wrong_answer(rng, "near", a, b)


def operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


def draw_pairs(rng: random.Random, prompts: list[str], n: int) -> list[tuple[str, str, str, str]]:
    """``n`` (prompt, chosen, rejected, kind) drawn from ``prompts``."""
    kinds, weights = zip(*KINDS)
    out = []
    for _ in range(n):
        prompt = rng.choice(prompts)
        a, b = operands(prompt)
        kind = rng.choices(kinds, weights)[0]
        out.append((prompt, str(a + b), wrong_answer(rng, kind, a, b), kind))
    return out


def build_model(tokenizer, hidden: int, layers: int, seed: int):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=4 * hidden,
                         max_position_embeddings=128, num_labels=1, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return Qwen2ForSequenceClassification(config)


def forward_pairs(model, lm_head, tokenizer, pairs, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``[2B]`` (chosen rows, then rejected rows), rendered as ``reward_model`` renders
    them and pooled at each row's last token, in length-sorted micro-batches; and the
    auxiliary next-token loss of the chosen rows' answers (each answer then ``<eos>``)."""
    texts = [(p, c) for p, c, _, _ in pairs] + [(p, r) for p, _, r, _ in pairs]
    rows = [render(tokenizer, p, r) for p, r in texts]
    answer_from = [len(render(tokenizer, p, "")) for p, _ in texts]  # first response position
    scores: list[torch.Tensor | None] = [None] * len(rows)
    lm_losses = []
    for batch in plan_microbatches([len(r) for r in rows], max_tokens):
        width = len(rows[batch[0]])  # longest first
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)  # (b, S)
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # (b, S)
        target = torch.full((len(batch), width), -100)  # (b, S): next answer token, chosen rows only
        for j, i in enumerate(batch):
            ids[j, :len(rows[i])], mask[j, :len(rows[i])] = torch.tensor(rows[i]), 1
            if i < len(pairs):
                answer = rows[i][answer_from[i]:] + [tokenizer.eos_token_id]
                target[j, answer_from[i] - 1:len(rows[i])] = torch.tensor(answer)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (b, S, H)
        last = mask.sum(-1) - 1  # (b,)
        for j, value in zip(batch, model.score(hidden[torch.arange(len(batch)), last])[:, 0]):
            scores[j] = value
        if (target != -100).any():
            lm_losses.append(F.cross_entropy(lm_head(hidden[target != -100]), target[target != -100],
                                             reduction="sum"))
    n_targets = sum(len(rows[i]) - answer_from[i] + 1 for i in range(len(pairs)))
    return torch.stack(scores), torch.stack(lm_losses).sum() / n_targets


def train(model, tokenizer, prompts: list[str], args) -> None:
    rng = random.Random(args.seed)
    # an auxiliary head that predicts the correct answer's digits: a dense signal that teaches
    # the base model addition far sooner than the pairwise loss alone; dropped when saving
    lm_head = torch.nn.Linear(model.config.hidden_size, len(tokenizer))
    params = list(model.parameters()) + list(lm_head.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    model.train()
    bar = tqdm(range(args.steps), desc="reward model", unit="step")
    for step in bar:
        pairs = draw_pairs(rng, prompts, args.batch)
        scores, lm_loss = forward_pairs(model, lm_head, tokenizer, pairs, args.max_tokens)
        chosen, rejected = scores[:args.batch], scores[args.batch:]  # (B,), (B,)
        bt = -F.logsigmoid(chosen - rejected).mean()
        loss = bt + args.center * ((chosen + rejected) ** 2).mean() + args.aux * lm_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0:
            acc = (chosen > rejected).float().mean().item()
            bar.set_postfix(bt=f"{bt.item():.3f}", lm=f"{lm_loss.item():.3f}", acc=f"{acc:.3f}")
    model.eval()


def evaluate(path: str, prompts: list[str], seed: int) -> dict[str, float]:
    """Held-out numbers, scored through ``reward_model`` from the saved directory."""
    rng = random.Random(seed + 1)
    rm = RewardModel(path=path)
    kinds = [k for k, _ in KINDS]
    responses, texts = [], []
    for prompt in prompts:
        a, b = operands(prompt)
        responses.append([str(a + b)] + [wrong_answer(rng, kind, a, b) for kind in kinds])
        texts += [prompt] * (1 + len(kinds))
    flat = rm([r for rs in responses for r in rs], [None] * len(texts), texts)
    per_prompt = [flat[i * (1 + len(kinds)):(i + 1) * (1 + len(kinds))] for i in range(len(prompts))]
    out = {f"acc/{kind}": sum(s[0] > s[1 + k] for s in per_prompt) / len(prompts) for k, kind in enumerate(kinds)}
    out["acc/pairwise"] = sum(out[f"acc/{k}"] for k in kinds) / len(kinds)
    out["acc/beats_all_kinds"] = sum(all(s[0] > x for x in s[1:]) for s in per_prompt) / len(prompts)
    out["score/correct"] = sum(s[0] for s in per_prompt) / len(prompts)
    out["score/incorrect"] = sum(x for s in per_prompt for x in s[1:]) / (len(prompts) * len(kinds))
    out["top1/all_3_digit_strings"] = _top1_exhaustive(rm, prompts[:EXHAUSTIVE_PROMPTS])
    return out


def _top1_exhaustive(rm: RewardModel, prompts: list[str]) -> float:
    """Share of prompts whose correct answer scores above every other string of at most
    three digits (1,111 candidates, leading zeros included): no nearby number outranks it."""
    candidates = [""] + [f"{i:0{k}d}" for k in (1, 2, 3) for i in range(10 ** k)]
    wins = 0
    for prompt in prompts:
        scores = rm(candidates, [None] * len(candidates), [prompt] * len(candidates))
        a, b = operands(prompt)
        wins += candidates[max(range(len(candidates)), key=scores.__getitem__)] == str(a + b)
    return wins / len(prompts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/rm_arith", help="where to save the HF directory (model + tokenizer)")
    # addition emerges after ~1000 steps (the auxiliary loss drops from ~1 to ~0.05); the rest,
    # with weight decay, makes near misses reliable on unseen prompts (2500 steps at weight
    # decay 0.01 left 10-15% of off-by-one pairs misranked in two runs out of three)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=64, help="pairs per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's; favours adding over memorizing")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--aux", type=float, default=1.0, help="weight of the auxiliary answer-prediction loss")
    p.add_argument("--max-tokens", type=int, default=512, help="padded tokens per micro-batch")
    p.add_argument("--center", type=float, default=0.01, help="center_rewards_coefficient (TRL's name)")
    p.add_argument("--seed", type=int, default=0, help="data.seed of the job (the same train/held-out split)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    train_set, held_out = arithmetic_splits(num_digits=2, operations="+", train_size=20000, eval_size=256,
                                            seed=args.seed)  # the default job's data.* settings
    tokenizer = builtin_tokenizer()
    model = build_model(tokenizer, args.hidden, args.layers, args.seed)
    t0 = time.perf_counter()
    train(model, tokenizer, [ex.prompt for ex in train_set], args)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved {args.out} ({sum(t.numel() for t in model.parameters()) / 1e6:.2f}M parameters, "
          f"{time.perf_counter() - t0:.0f} s)")
    # held-out: prompts no step trained on; train: the prompts a PPO run on this task scores
    seen = random.Random(args.seed + 2).sample([ex.prompt for ex in train_set], len(held_out))
    for split, prompts in (("held-out", [ex.prompt for ex in held_out]), ("train", seen)):
        for key, value in evaluate(args.out, prompts, args.seed).items():
            print(f"{split:8s} {key:28s} {value:8.3f}")


if __name__ == "__main__":
    main()
