"""An episode as the trainer sees it: one token sequence with a loss mask.

``ids`` = the opening prompt, then per turn the ids the engine sampled (ending with the
end-of-turn token) followed by the environment's / tools' messages rendered on their own
(``chat_render.py``). ``loss_mask`` is 1 exactly on sampled ids; ``logprobs`` and
``versions`` are the engine's there (0.0 / -1 elsewhere). Nothing is re-tokenized.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from hybridrl.data.vision import ImageInputs, RowImages
from hybridrl.rollout.rollouts import Rollouts, build_rollouts

STATUSES = ("ok", "truncated", "failed")


@dataclass
class Trajectory:
    episode_id: str
    row: int
    """index of the data row the episode was reset with (its group)."""
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) of each sampled turn in ``ids``."""
    turn_rewards: list[float] = field(default_factory=list)
    outcome: float | None = None
    """the outcome reward (environment: the turn rewards combined; tools: the reward of the final answer)."""
    final_answer: str | None = None
    status: str = "ok"
    """"ok" (the environment said done), "truncated" (max_turns, the context budget, or a
    turn that hit max_tokens without ending), "failed" (an infrastructure failure)."""
    failure: str | None = None
    tool_calls: int = 0
    tool_errors: Counter = field(default_factory=Counter)
    env_seconds: float = 0.0
    images: ImageInputs | None = None
    """every image in ``ids`` (the opening's and the environment's), in order: what the
    engine was given with the last turn (a VL policy); None for text."""

    def __post_init__(self):
        if not self.ids:
            self.ids = list(self.prompt_ids)
            self.loss_mask = [0] * len(self.ids)
            self.logprobs = [0.0] * len(self.ids)
            self.versions = [-1] * len(self.ids)

    def add_sampled(self, tokens: list[int], logprobs: list[float], versions: list[int]) -> None:
        start = len(self.ids)
        self.ids += tokens
        self.loss_mask += [1] * len(tokens)
        self.logprobs += logprobs
        self.versions += versions
        self.turns.append((start, len(self.ids)))

    def add_observed(self, tokens: list[int]) -> None:
        """Environment / tool tokens: in the sequence, never trained."""
        self.ids += tokens
        self.loss_mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [-1] * len(tokens)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)


def trajectories_to_rollouts(trajs: list[Trajectory], pad_token_id: int = 0) -> Rollouts:
    """``Rollouts`` whose ``response_mask`` is the loss mask (0 on environment spans) and whose
    "response" is everything after the opening prompt; failed episodes keep their tokens and
    are masked out by the caller."""
    prompts = [t.prompt_ids for t in trajs]
    rest = [t.ids[len(t.prompt_ids):] for t in trajs]
    lps = [t.logprobs[len(t.prompt_ids):] for t in trajs]
    reasons = [t.status for t in trajs]
    versions = [v for t in trajs for v in t.versions[len(t.prompt_ids):] if v >= 0]
    ro = build_rollouts(prompts, rest, lps, reasons, min(versions, default=0), pad_token_id)
    L = ro.input_ids.shape[1]
    mask = torch.zeros(len(trajs), L)
    tv = torch.full((len(trajs), L), -1, dtype=torch.long)
    for b, t in enumerate(trajs):
        mask[b, :len(t.ids)] = torch.tensor(t.loss_mask, dtype=torch.float32)
        tv[b, :len(t.ids)] = torch.tensor(t.versions, dtype=torch.long)
    ro.response_mask, ro.token_versions = mask, tv
    ro.logprobs = ro.logprobs * mask  # 0.0 off the sampled tokens (build_rollouts filled every "response" slot)
    if any(t.images is not None for t in trajs):
        ro.images = RowImages([t.images for t in trajs])
    return ro


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Turns, tool calls and errors by kind, truncated / failed shares, trained-token share, env time."""
    B = max(1, len(trajs))
    errors: Counter = Counter()
    for t in trajs:
        errors.update(t.tool_errors)
    total_tokens = sum(len(t.ids) - len(t.prompt_ids) for t in trajs)
    out = {"agent/turns": sum(t.num_turns for t in trajs) / B,
           "agent/tool_calls": sum(t.tool_calls for t in trajs) / B,
           "agent/tool_errors": sum(errors.values()) / B,
           "agent/truncated": sum(t.status == "truncated" for t in trajs) / B,
           "agent/failed": sum(t.status == "failed" for t in trajs) / B,
           "agent/trained_token_share": sum(t.trained_tokens for t in trajs) / max(1, total_tokens),
           "agent/env_seconds": sum(t.env_seconds for t in trajs)}
    out.update({f"agent/tool_errors/{kind.replace(' ', '_')}": n / B for kind, n in errors.items()})
    return out
