"""Multi-turn demonstrations laid out token-in/token-out exactly as the episode runner lays
out an episode (``agents/episodes.py``), so the warm start and RL train on one layout.

A demonstration is the assistant turns a teacher says; the tools answer them for real
(the tools class, in this process). Its ids are the opening prompt
(``ChatRenderer.opening``), then per turn the turn's ids plus the end-of-turn token, then
the tool messages (``ChatRenderer.continuation``). ``loss_mask`` is 1 exactly on the turns'
ids and end-of-turn tokens: the tokens a policy would have sampled; prompt and tool spans
are 0 (the runner's ``Trajectory.loss_mask`` is the same).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Demo:
    ids: list[int]
    loss_mask: list[int]
    """same length as ``ids``; 1 on the assistant's turns (end-of-turn tokens included)."""


class DemoRenderer:
    """Renders demonstrations with a tools class, its tool environment settings and a chat renderer.

    ``tools``: an ``agents.tool_env.ToolEnvironment`` (run in-process: the same parsing and
    tool messages as ``EnvPool``); ``context_tokens``: the runner's episode budget, which a
    demonstration must fit as an episode would."""

    def __init__(self, tools: Any, renderer: Any, tokenizer: Any, *, context_tokens: int):
        self.tools, self.renderer, self.tokenizer = tools, renderer, tokenizer
        self.context_tokens = context_tokens

    def render(self, row: dict, turns: list[str]) -> Demo:
        """The episode in which the model said ``turns``; the last turn must end it (no tool call)."""
        tools, r = self.tools, self.renderer
        ids = r.opening(tools.reset(row))
        mask = [0] * len(ids)
        for k, text in enumerate(turns):
            said = self.tokenizer.encode(text, add_special_tokens=False) + [r.end_of_turn_id]
            if r.text(said) != text:  # the runner hands the tools the decoded turn, not the demo's string
                raise ValueError(f"demonstration turn {text[:40]!r} does not survive encode/decode; use characters "
                                 "the tokenizer has")
            ids += said
            mask += [1] * len(said)
            step = tools.step(text)
            if step.done != (k == len(turns) - 1):
                raise ValueError(f"demonstration for {row.get('prompt')!r}: turn {k + 1} of {len(turns)} "
                                 f"{'ends' if step.done else 'does not end'} the episode; only the last turn may "
                                 "answer without a tool call")
            if not step.done:
                cont = r.continuation(step.messages)
                ids += cont
                mask += [0] * len(cont)
        if len(ids) >= self.context_tokens:
            raise ValueError(f"a demonstration is {len(ids)} tokens, over env.context_tokens={self.context_tokens}; "
                             "raise env.context_tokens or shorten the task")
        return Demo(ids, mask)


class TeacherDemos:
    """An imperfect teacher over the training rows: row ``i`` is demonstrated one of two ways
    (``ways(i, uses_tool) -> turns``), with the tool with probability ``tool_rates[i]``, drawn
    afresh at every visit from the caller's teacher stream. Rendered on first use, then kept."""

    def __init__(self, rows: list[dict], tool_rates: list[float], ways: Callable[[int, bool], list[str]],
                 renderer: DemoRenderer):
        if len(rows) != len(tool_rates):
            raise ValueError(f"TeacherDemos: {len(rows)} rows but {len(tool_rates)} tool rates")
        self.rows, self.tool_rates, self.ways, self.renderer = rows, tool_rates, ways, renderer
        self._cache: dict[tuple[int, bool], Demo] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def demo(self, i: int, uses_tool: bool) -> Demo:
        key = (i, uses_tool)
        if key not in self._cache:
            self._cache[key] = self.renderer.render(self.rows[i], self.ways(i, uses_tool))
        return self._cache[key]

    def sample(self, rng: random.Random, k: int, teacher_rng: random.Random) -> list[Demo]:
        """``k`` demonstrations of rows drawn with replacement from ``rng``."""
        idx = [rng.randrange(len(self.rows)) for _ in range(k)]
        return [self.demo(i, teacher_rng.random() < self.tool_rates[i]) for i in idx]
