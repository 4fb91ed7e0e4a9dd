"""The built-in agent task: additions of long numbers (``48213977+603512=``) that a tiny model
cannot do in its head but can do with the ``add`` tool (``agents/examples/calculator.py``),
and the imperfect teacher whose demonstrations warm-start it.

An episode the task rewards has two turns: the model calls the tool
(``<tool_call>{"name":"add","arguments":{"a":48213977,"b":603512}}</tool_call>``), the tool
message brings the sum, the model answers it (exact match). The teacher knows this, but
trusts its head arithmetic too much: it calls the tool on ``teacher_tool_rate`` of the
problems, on ``teacher_tool_rate_longest`` of those whose first number has the most
digits, and otherwise answers at once with a near miss (the sum with one digit off by
one), which is always wrong. Imitation learns the teacher's habit; only the reward can
teach that the calculator is worth calling every time.

Prompts are drawn deterministically from a seed; the held-out split is disjoint from the
training split (no prompt string appears in both).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

TOOL = "add"


@dataclass(frozen=True)
class CalcExample:
    prompt: str
    """``"{a}+{b}="``, the user message."""
    answer: str
    """the exact sum, what the final answer must be."""
    a: int
    b: int
    tool_rate: float
    """the teacher's probability of calling the tool on this problem."""
    guess: str
    """the teacher's head answer: the sum with one digit off by one (never right)."""

    def tool_call_text(self) -> str:
        """The assistant turn that calls the tool (Hermes format, compact JSON)."""
        call = {"name": TOOL, "arguments": {"a": self.a, "b": self.b}}
        return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"

    def teacher_turns(self, uses_tool: bool) -> list[str]:
        """The teacher's assistant turns: a tool call then the tool's result, or the guess."""
        return [self.tool_call_text(), self.answer] if uses_tool else [self.guess]


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def near_miss(rng: random.Random, value: int) -> str:
    """``value`` with one digit changed by one (never the leading digit, so the length stays)."""
    s = list(str(value))
    if len(s) == 1:
        return str(value + 1)
    i = rng.randrange(1, len(s))
    s[i] = str((int(s[i]) + rng.choice((-1, 1))) % 10)
    return "".join(s)


def make_calc_example(rng: random.Random, min_digits: int, max_digits: int, tool_rate: float,
                      tool_rate_longest: float) -> CalcExample:
    da, db = rng.randint(min_digits, max_digits), rng.randint(min_digits, max_digits)
    a, b = _number(rng, da), _number(rng, db)
    rate = tool_rate_longest if da == max_digits else tool_rate
    return CalcExample(prompt=f"{a}+{b}=", answer=str(a + b), a=a, b=b, tool_rate=rate, guess=near_miss(rng, a + b))


def calculator_splits(*, min_digits: int, max_digits: int, train_size: int, eval_size: int, seed: int,
                      tool_rate: float, tool_rate_longest: float) -> tuple[list[CalcExample], list[CalcExample]]:
    """Deterministic ``(train, eval)``; eval prompts never occur in train."""
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"calculator task: digits {min_digits}..{max_digits}: need 1 <= min <= max")
    rng = random.Random(seed)

    def draw() -> CalcExample:
        return make_calc_example(rng, min_digits, max_digits, tool_rate, tool_rate_longest)

    seen: set[str] = set()
    evals: list[CalcExample] = []
    for _ in range(50 * max(1, eval_size)):
        if len(evals) >= eval_size:
            break
        ex = draw()
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            evals.append(ex)
    train: list[CalcExample] = []
    for _ in range(50 * max(1, train_size)):
        if len(train) >= train_size:
            break
        ex = draw()
        if ex.prompt not in seen:
            train.append(ex)
    return train, evals
