"""A format reward: 1.0 when the response matches a regular expression, else 0.0.

The default pattern is the DeepSeek-R1 layout, reasoning in ``<think>`` then the answer
in ``<answer>``. The pattern comes from the user's config, and a backtracking pattern can
run for minutes while holding the GIL, so this reward is *not* trusted: it runs in the
runner's worker processes, where a timeout can kill it.
"""

from __future__ import annotations

import re

from hybridrl.rewards.registry import register_reward_factory

R1_PATTERN = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


class FormatReward:
    """``re.search(pattern, response, DOTALL)`` as 1.0 / 0.0 (anchor with ``^``/``$``).

    A class rather than a closure so that it pickles (by its pattern) into workers."""

    hybridrl_trusted = False
    hybridrl_label = "format"

    def __init__(self, pattern: str = R1_PATTERN):
        if not isinstance(pattern, str):
            raise ValueError(f"format reward: pattern={pattern!r} must be a string (a regular expression)")
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise ValueError(f"format reward: pattern {pattern!r} is not a valid regex ({e}); fix the pattern") from None
        self.pattern = pattern

    def __call__(self, response: str, answer=None, prompt: str = "") -> float:
        return float(self.regex.search(response) is not None)

    def __reduce__(self):
        return FormatReward, (self.pattern,)

    def __repr__(self) -> str:
        return f"FormatReward({self.pattern!r})"


@register_reward_factory("format")
def format_reward(pattern: str = R1_PATTERN) -> FormatReward:
    """The ``format`` reward for ``pattern`` (default: ``<think>…</think><answer>…</answer>``)."""
    return FormatReward(pattern)
