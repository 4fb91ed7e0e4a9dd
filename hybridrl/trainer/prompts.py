"""A prompt set: token ids, ground truths for the reward, and prompt texts (row-aligned)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptSet:
    prompts: list[list[int]] = field(default_factory=list)  # token ids per prompt
    answers: list[Any] = field(default_factory=list)  # ground truth passed to the reward
    prompt_texts: list[str] = field(default_factory=list)  # passed to the reward as `prompt`

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, idx: list[int]) -> "PromptSet":
        return PromptSet([self.prompts[i] for i in idx], [self.answers[i] for i in idx],
                         [self.prompt_texts[i] for i in idx])
