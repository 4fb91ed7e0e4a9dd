"""The built-in agent task: additions of long numbers (``4821397+3035126=``) that a tiny model
cannot do in its head but can do with the ``add`` tool (``agents/examples/calculator.py``),
and the imperfect teacher whose demonstrations warm-start it.

An episode the task rewards has two turns: the model calls the tool
(``<tool_call>{"name":"add","arguments":{"a":4821397,"b":3035126}}</tool_call>``), the tool
message brings the sum, the model answers it. The reward is ``last_number`` (the last
integer of the final answer equals the sum).

The teacher trusts its head arithmetic too much: it calls the tool on ``tool_rate`` of the
problems (``tool_rate_big`` of those whose first number starts with 7 or 8, which look
big), and otherwise answers at once with an estimate, ``~`` and the sum with one digit off
by one — always wrong. Imitation learns the habit, and its greedy policy follows the
teacher's majority: estimate, except on the big-looking problems. Only the reward can
teach that the calculator is worth calling every time.

Both numbers have ``digits`` digits and so does their sum (no carry out of the top digit):
every digit the model copies (prompt -> tool call, tool message -> answer) sits at a fixed
distance from its source, a pattern a 2-layer char-level model learns in a few hundred
supervised steps. Prompts are drawn deterministically from a seed; the held-out split is
disjoint from the training split (no prompt string appears in both).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

TOOL = "add"
ESTIMATE = "~"  # what the teacher writes before a head estimate


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
    estimate: str
    """the teacher's head answer: ``~`` and the sum with one digit off by one (never right)."""

    def tool_call_text(self) -> str:
        """The assistant turn that calls the tool (Hermes format, compact JSON)."""
        call = {"name": TOOL, "arguments": {"a": self.a, "b": self.b}}
        return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"

    def teacher_turns(self, uses_tool: bool) -> list[str]:
        """The teacher's assistant turns: a tool call then the tool's result, or the estimate."""
        return [self.tool_call_text(), self.answer] if uses_tool else [self.estimate]


def near_miss(rng: random.Random, value: int) -> str:
    """``value`` with one digit changed by one (never the leading digit, so the length stays)."""
    s = list(str(value))
    if len(s) == 1:
        return str(value + 1)
    i = rng.randrange(1, len(s))
    s[i] = str((int(s[i]) + rng.choice((-1, 1))) % 10)
    return "".join(s)


def make_calc_example(rng: random.Random, digits: int, tool_rate: float, tool_rate_big: float) -> CalcExample:
    low = 10 ** (digits - 1)
    a = rng.randint(low, 9 * low - 1)  # leaves room for a b of `digits` digits below 10**digits
    b = rng.randint(low, 10**digits - 1 - a)
    rate = tool_rate_big if str(a)[0] >= "7" else tool_rate
    return CalcExample(prompt=f"{a}+{b}=", answer=str(a + b), a=a, b=b, tool_rate=rate,
                       estimate=ESTIMATE + near_miss(rng, a + b))


def calculator_splits(*, digits: int, train_size: int, eval_size: int, seed: int, tool_rate: float,
                      tool_rate_big: float) -> tuple[list[CalcExample], list[CalcExample]]:
    """Deterministic ``(train, eval)``; eval prompts never occur in train."""
    if digits < 2:
        raise ValueError(f"calculator task: {digits} digits; use at least 2")
    rng = random.Random(seed)

    def draw() -> CalcExample:
        return make_calc_example(rng, digits, tool_rate, tool_rate_big)

    seen: set[str] = set()
    evals = _draw_unseen(draw, eval_size, seen, remember=True)  # distinct prompts
    train = _draw_unseen(draw, train_size, seen, remember=False)  # may repeat among themselves
    return train, evals


def _draw_unseen(draw: Callable[[], CalcExample], size: int, seen: set[str], *,
                 remember: bool) -> list[CalcExample]:
    """Up to ``size`` drawn examples whose prompt is not in ``seen`` (at most ``50 * size``
    draws); with ``remember``, each kept prompt joins ``seen``."""
    out: list[CalcExample] = []
    for _ in range(50 * max(1, size)):
        if len(out) >= size:
            break
        ex = draw()
        if ex.prompt not in seen:
            if remember:
                seen.add(ex.prompt)
            out.append(ex)
    return out
