"""The built-in task: arithmetic prompts like ``37+45=`` with an exact-answer reward.

Prompts are drawn deterministically from a seed; the held-out split is disjoint from the
training split (no prompt string appears in both).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    slip: str | None = None  # the answer with the units carry forgotten (additions that carry), else None


def _solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def carry_slip(a: int, op: str, b: int) -> int | None:
    """The classic slip of forgetting the carry out of the units column: ``37+45`` -> ``72``
    (not 82), ``95+15`` -> ``100``. None when the problem has no units carry (or is not an
    addition): there is nothing to forget."""
    if op != "+" or a % 10 + b % 10 < 10:
        return None
    return a + b - 10


def make_example(rng: random.Random, num_digits: int, operations: str) -> Example:
    lo, hi = 0, 10**num_digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    op = rng.choice(operations)
    slip = carry_slip(a, op, b)
    return Example(prompt=f"{a}{op}{b}=", answer=str(_solve(a, op, b)), slip=None if slip is None else str(slip))


def arithmetic_splits(*, num_digits: int, operations: str, train_size: int, eval_size: int,
                      seed: int) -> tuple[list[Example], list[Example]]:
    """Deterministic ``(train, eval)``; eval prompts never occur in train.

    The number of distinct problems is ``(10**d)**2 * len(ops)``; when the requested
    sizes exceed it, train is capped to what remains after eval.
    """
    rng = random.Random(seed)
    space = (10**num_digits) ** 2 * len(operations)
    eval_size = min(eval_size, space // 2)
    seen: set[str] = set()
    evals: list[Example] = []
    while len(evals) < eval_size:
        ex = make_example(rng, num_digits, operations)
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            evals.append(ex)
    train: list[Example] = []
    budget = min(train_size, space - len(evals))
    attempts = 0
    while len(train) < budget and attempts < 50 * budget:
        attempts += 1
        ex = make_example(rng, num_digits, operations)
        if ex.prompt not in seen:
            train.append(ex)
    return train, evals
