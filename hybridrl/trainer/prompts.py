"""A prompt set: token ids, ground truths for the reward, prompt texts and, for a
vision-language model, each prompt's images (row-aligned)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridrl.data.vision import ImageInputs


@dataclass
class PromptSet:
    prompts: list[list[int]] = field(default_factory=list)  # token ids per prompt
    answers: list[Any] = field(default_factory=list)  # ground truth passed to the reward
    prompt_texts: list[str] = field(default_factory=list)  # passed to the reward as `prompt`
    images: list[ImageInputs | None] = field(default_factory=list)  # per prompt; empty = all text-only

    def __post_init__(self) -> None:
        if not self.images:
            self.images = [None] * len(self.prompts)
        if len(self.images) != len(self.prompts):
            raise ValueError(f"PromptSet: {len(self.images)} image entries for {len(self.prompts)} prompts")

    def __len__(self) -> int:
        return len(self.prompts)

    def images_of(self, row: int) -> ImageInputs | None:
        """Row ``row``'s images (None: a text-only row or set)."""
        return self.images[row] if self.images else None

    def subset(self, idx: list[int]) -> "PromptSet":
        return PromptSet([self.prompts[i] for i in idx], [self.answers[i] for i in idx],
                         [self.prompt_texts[i] for i in idx], [self.images[i] for i in idx])
