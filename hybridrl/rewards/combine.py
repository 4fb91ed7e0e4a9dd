"""Weighted sums of rewards, e.g. correctness plus a small format bonus.

``combine([("math_verify", 1.0), ("format", 0.1)])`` scores ``1.0 * math_verify + 0.1 *
format`` and reports each component's unweighted score as an extra metric under its
label (a component's own extras appear as ``label/key``). A component that fails a
sample fails the sum for that sample, with the component named in the reason.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from hybridrl.rewards.outcome import Outcome, RewardFailure, call_batch, call_one
from hybridrl.rewards.registry import RewardFn, get_reward_fn, is_batched, is_trusted, reward_label


class CombinedReward:
    """``sum(weight * component)`` over ``parts`` given as ``(label, fn, weight)``.

    Trusted only when every component is; batched when any component is (the
    per-sample components are then looped over the batch, one Outcome each)."""

    def __init__(self, parts: Sequence[tuple[str, RewardFn, float]]):
        if not parts:
            raise ValueError("combine(): give at least one (reward, weight) pair")
        self.parts = list(parts)
        self.hybridrl_trusted = all(is_trusted(fn) for _, fn, _ in self.parts)
        self.hybridrl_batched = any(is_batched(fn) for _, fn, _ in self.parts)

    def __call__(self, response, answer, prompt):
        """One sample -> ``{"score", **components}``; in batched mode the arguments are
        lists and the result is one such dict (or a RewardFailure) per sample."""
        if self.hybridrl_batched:
            return self._call_batch(response, answer, prompt)
        total = self._sum([[call_one(fn, response, answer, prompt)] for _, fn, _ in self.parts], 0)
        if isinstance(total, RewardFailure):
            raise total
        return total

    def _call_batch(self, responses: list[str], answers: list, prompts: list[str]) -> list:
        per_part = [call_batch(fn, responses, answers, prompts) if is_batched(fn)
                    else [call_one(fn, r, a, p) for r, a, p in zip(responses, answers, prompts)]
                    for _, fn, _ in self.parts]
        return [self._sum(per_part, i) for i in range(len(responses))]

    def _sum(self, per_part: list[list[Outcome]], i: int) -> dict[str, float] | RewardFailure:
        result: dict[str, float] = {"score": 0.0}
        for (label, _, weight), outcomes in zip(self.parts, per_part):
            outcome = outcomes[i]
            if outcome.failure is not None:
                return RewardFailure(f"{label}: {outcome.failure}", f"{label}: {outcome.detail}")
            result["score"] += weight * outcome.score
            result[label] = outcome.score
            for key, value in (outcome.extras or {}).items():
                result[f"{label}/{key}"] = value
        return result

    def hybridrl_warmup(self) -> None:
        for _, fn, _ in self.parts:
            warmup = getattr(fn, "hybridrl_warmup", None)
            if warmup is not None:
                warmup()

    def __repr__(self) -> str:
        return "CombinedReward(" + ", ".join(f"{label}*{w:g}" for label, _, w in self.parts) + ")"


def combine(parts: Sequence[tuple[str | RewardFn, float]]) -> CombinedReward:
    """A weighted sum of rewards given as ``(name_or_fn, weight)``; labels come from the
    names (repeats get ``_2``, ``_3``...)."""
    labelled: list[tuple[str, RewardFn, float]] = []
    for i, (reward, weight) in enumerate(parts):
        fn = get_reward_fn(reward, where=f"combine()[{i}]") if isinstance(reward, str) else reward
        labelled.append((_reward_name(reward, fn), fn, check_weight(weight, f"combine()[{i}]")))
    return CombinedReward(unique_labels(labelled))


def _reward_name(reward: str | RewardFn, fn: RewardFn) -> str:
    if isinstance(reward, str):
        return reward.rpartition(":")[2]  # "path/to/file.py:my_fn" -> "my_fn"
    return reward_label(fn)


def check_weight(weight: Any, where: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise ValueError(f"{where}.weight={weight!r}: must be a finite number")
    return float(weight)


def unique_labels(parts: list[tuple[str, RewardFn, float]]) -> list[tuple[str, RewardFn, float]]:
    """Suffix repeated labels so each component keeps its own metric."""
    seen: dict[str, int] = {}
    out = []
    for label, fn, weight in parts:
        seen[label] = seen.get(label, 0) + 1
        out.append((label if seen[label] == 1 else f"{label}_{seen[label]}", fn, weight))
    return out
