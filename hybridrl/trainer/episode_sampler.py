"""The rollout phase of an agent run: a step's prompts become episodes (``agents/``), each
scored by its outcome, laid out as one ``StepBatch`` whose loss mask is 1 on sampled
tokens only.

Outcome reward: an environment's turn rewards, summed (``discount`` 1) or discounted from
the last turn back; a tool environment's final answer scored by the run's reward
(``reward.functions``), as a single-turn answer would be. A *failed* episode (an
infrastructure failure) gets its own group and an all-zero loss mask: it neither trains
nor moves its row's GRPO baseline (a fake zero reward would).
"""

from __future__ import annotations

from collections import Counter

import torch

from hybridrl.agents.episodes import EpisodeRunner
from hybridrl.agents.trajectory import Trajectory, trajectories_to_rollouts
from hybridrl.trainer.prompts import PromptSet
from hybridrl.trainer.scoring import RewardScorer
from hybridrl.trainer.step_batch import StepBatch


class EpisodeSampler:
    def __init__(self, runner: EpisodeRunner, scorer: RewardScorer, *, scores_final_answer: bool,
                 discount: float = 1.0, failure_reward: float = 0.0):
        self.runner, self.scorer = runner, scorer
        self.scores_final_answer = scores_final_answer  # tool environments: the reward scores the answer
        self.discount, self.failure_reward = discount, failure_reward

    def sample(self, train_set: PromptSet, batch_idx: list[int], seeds: list[int], n: int,
               device: torch.device) -> StepBatch:
        rows = [{"prompt": train_set.prompt_texts[i], "answer": train_set.answers[i]} for i in batch_idx]
        trajs = self.runner.run(rows, n, seeds)
        scores = self._outcomes(trajs, rows)
        ro = trajectories_to_rollouts(trajs, getattr(self.runner.engine, "pad_token_id", 0))
        index = []
        for b, t in enumerate(trajs):
            if t.status == "failed":  # alone in its group, nothing trained
                index.append(len(batch_idx) + b)
                ro.response_mask[b] = 0.0
            else:
                index.append(t.row)
        for name in ("input_ids", "attention_mask", "response_mask", "logprobs", "token_versions"):
            setattr(ro, name, getattr(ro, name).to(device))
        sb = StepBatch.from_rollouts(batch_idx, index, ro)
        sb.raw_scores = sb.scores = torch.tensor(scores, dtype=torch.float32, device=device)
        sb.failures = sum(t.status == "failed" for t in trajs)
        sb.episode_metrics = episode_metrics(trajs)
        return sb

    def _outcomes(self, trajs: list[Trajectory], rows: list[dict]) -> list[float]:
        for t in trajs:
            t.outcome = _discounted(t.turn_rewards, self.discount)
        if self.scores_final_answer:
            answered = [t for t in trajs if t.final_answer is not None]
            if answered:
                rb = self.scorer.runner.score([t.final_answer for t in answered], [rows[t.row]["answer"] for t in answered],
                                              [str(rows[t.row]["prompt"]) for t in answered])
                for t, s in zip(answered, rb.scores):
                    t.outcome += s
        return [self.failure_reward if t.status == "failed" else t.outcome for t in trajs]


def _discounted(rewards: list[float], discount: float) -> float:
    total = 0.0
    for r in reversed(rewards):
        total = r + discount * total
    return total


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Turns, tool calls and errors by kind, truncated / failed shares, trained-token share, env time."""
    B = max(1, len(trajs))
    errors = Counter()
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
