"""The data of one RL step as it moves through the phases.

Rows are prompt-major: ``rollout.n`` consecutive samples per prompt, ``index[b]`` the
prompt id (group) of row b. Tensors are ``[B, L]`` right-padded rows on the trainer
device (docs/interfaces.md), plus ``prompt_len`` and ``group`` ``[B]``.

One home per field: the sampled response mask lives in ``rollouts`` only; the tokens the
losses count (that mask after the corrections: sequence masking, DAPO's overlong filter)
are ``loss_mask``, set by the corrections phase. :meth:`StepBatch.update_batch` hands the
update the latter under the name the losses use (``response_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridrl.rollout import Rollouts


@dataclass
class StepBatch:
    batch_idx: list[int]  # training-set row of each prompt
    index: list[int]  # prompt id of each response row [B]
    rollouts: Rollouts  # tensors on the trainer device
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # per-row inputs of the update (no masks)
    raw_scores: torch.Tensor | None = None  # [B] verifier scores
    scores: torch.Tensor | None = None  # [B] after overlong shaping
    returns: torch.Tensor | None = None  # [B, L]
    values: torch.Tensor | None = None  # [B, L] critic values (gae)
    failures: int = 0  # reward calls that failed (scored 0)
    extras: dict[str, float] = field(default_factory=dict)  # reward-reported metrics (batch means)
    proximal_is_cap: float | None = None  # stale tokens, no old-log-prob pass: the update weights them
    loss_mask: torch.Tensor | None = None  # [B, L] the response tokens the losses count (after corrections)
    episode_metrics: dict[str, float] = field(default_factory=dict)  # agent runs: turns, tool calls, ...

    @classmethod
    def from_rollouts(cls, batch_idx: list[int], index: list[int], ro: Rollouts) -> "StepBatch":
        return cls(batch_idx=batch_idx, index=index, rollouts=ro, tensors=row_tensors(ro, index))

    @classmethod
    def from_groups(cls, batch_idx: list[int], n: int, ro: Rollouts) -> "StepBatch":
        """Rows prompt-major: ``n`` samples of each of ``batch_idx``'s prompts in turn."""
        return cls.from_rollouts(batch_idx, [i for i in range(len(batch_idx)) for _ in range(n)], ro)

    def update_batch(self, keep: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """What Actor/Critic.update read: the per-row tensors and ``response_mask`` = the
        loss mask (the sampled mask before any correction ran), and a VL policy's ``images``
        (``RowImages``), rows ``keep`` (default all)."""
        mask = self.loss_mask if self.loss_mask is not None else self.rollouts.response_mask
        batch = {**self.tensors, "response_mask": mask}
        if self.rollouts.images is not None:  # a VL policy's rows: RowImages, indexed like the tensors
            batch["images"] = self.rollouts.images
        return batch if keep is None else {k: v[keep] for k, v in batch.items()}


def row_tensors(ro: Rollouts, index: list[int]) -> dict[str, torch.Tensor]:
    """What the update reads per row: ``[B, L]`` tensors, plus ``prompt_len`` and ``group``
    ``[B]`` so the trainer can run each group's shared prompt once."""
    device = ro.input_ids.device
    out = {"input_ids": ro.input_ids, "attention_mask": ro.attention_mask, "rollout_log_prob": ro.logprobs,
           "prompt_len": torch.tensor(ro.prompt_lengths, dtype=torch.long, device=device),
           "group": torch.tensor(index, dtype=torch.long, device=device)}
    if ro.routed_experts is not None:  # MoE routing replay: [B, L, layers, k]
        out["routed_experts"] = ro.routed_experts
    return out
