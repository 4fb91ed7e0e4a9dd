"""Which prompts and seeds each RL step trains on, drawn ahead of the trainer.

An overlapped run generates for steps the trainer has not reached, so it draws their
prompts early — from the same RNG, in the same step order, with the same draw function
as a synchronous run. Step ``s`` therefore gets exactly the prompts and seeds a
synchronous run gives it (staleness 0 is then synchronous training, bitwise), and a
resumed run redraws every step it had not trained from the RNG state saved *before*
that step (never the state after the look-ahead, which would skip prompts).
"""

from __future__ import annotations

import random
from typing import Callable

Draw = Callable[[random.Random], tuple[list[int], list[int]]]


class PromptPlan:
    """``get(step) -> (batch_idx, seeds)``: training-set rows and one seed per row.

    ``draw(rng)`` is the synchronous sampler's own draw (``RLStep._draw``); steps are
    drawn strictly in order from ``first_step`` on, each once, and kept until
    :meth:`forget_before` drops the trained ones.
    """

    def __init__(self, draw: Draw, rng: random.Random, first_step: int):
        self._draw, self._rng = draw, rng
        self._steps: dict[int, tuple[list[int], list[int]]] = {}
        self._state_before: dict[int, tuple] = {first_step: rng.getstate()}
        self._next = first_step  # the next step to draw

    def get(self, step: int) -> tuple[list[int], list[int]]:
        if step < min(self._state_before):
            raise KeyError(f"PromptPlan: step {step} was already trained and forgotten")
        while self._next <= step:
            self._steps[self._next] = self._draw(self._rng)
            self._next += 1
            self._state_before[self._next] = self._rng.getstate()
        return self._steps[step]

    def state_before(self, step: int) -> tuple:
        """The RNG state a resumed run restores to redraw ``step`` and every later step."""
        if step > self._next:
            self.get(step - 1)
        return self._state_before[step]

    def forget_before(self, step: int) -> None:
        """Drop the steps before ``step`` (trained: never drawn again)."""
        for s in [s for s in self._state_before if s < step]:
            self._state_before.pop(s)
            self._steps.pop(s, None)

    def draw_extra(self, step: int, round_: int) -> tuple[list[int], list[int]]:
        """DAPO refill round ``round_`` of ``step``: the draw function over a stream of its
        own, seeded by the RNG state before ``step`` and the round (the same on every rank,
        which keeps its share), so the steps' draws are those of a run without refills and
        a resumed run redraws the same refills."""
        self.get(step)
        return self._draw(random.Random(hash((self._state_before[step], round_))))
