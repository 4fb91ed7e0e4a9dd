"""The kinds of group a batch source produces, in the trainer process: what work one
group is, how its finished samples are scored, and how a step's groups become its
``StepBatch``.

- :class:`SingleTurnGroups`: a group is ``rollout.n`` samples of one prompt, scored by
  the run's reward (``reward.functions``) as soon as its samples finished.
- :class:`EpisodeGroups`: a group is ``rollout.n`` agent episodes of one prompt
  (``env.name``), each scored by its outcome: the environment's turn rewards (summed, or
  discounted from the last turn back) plus, for a tools class, the reward of its final
  answer (or of its whole transcript, ``env.reward_input``). A *failed* episode (an infrastructure failure) gets its own group and an
  all-zero loss mask: it neither trains nor moves its row's GRPO baseline.

Both lay a step's rows out prompt-major, groups in draw order: the batch a synchronous
step would build. With an on-policy distillation ``teacher`` (``algo.distill``), each group
is also scored token by token as it finishes, beside the reward (overlapped with the
rollout of the other groups, and in the overlapped modes with training): the teacher's
log-probs of the model's tokens (an episode's environment spans are not the model's, and
are not scored), the step batch's ``teacher_log_prob``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from hybridrl.agents.trajectory import Trajectory, episode_metrics, trajectories_to_rollouts
from hybridrl.data.vision import VisionTokens
from hybridrl.data.vision_mask import vision_token_response_mask
from hybridrl.pipeline.work import EpisodeWork, SampleWork
from hybridrl.rewards import RewardBatch
from hybridrl.rollout.backend import request_seed
from hybridrl.rollout.rollouts import rollouts_from_outputs, rollouts_to_device
from hybridrl.trainer.step_batch import StepBatch


class SingleTurnGroups:
    kind = "single-turn"

    def __init__(self, train_set, scorer, sampling, *, pad_id: int, teacher=None, vision: VisionTokens | None = None):
        """``vision``: a VL policy's vision tokens: a sample that emitted one (the engines stop
        there) is kept in its group but masked out of the loss."""
        self.train_set, self.scorer, self.sampling, self.pad_id = train_set, scorer, sampling, pad_id
        self.n = sampling.n
        self.teacher = teacher  # a trainer.teacher.Teacher, or None
        self.vision = vision

    def work(self, row: int, seed: int, keys: list[str]) -> list[SampleWork]:
        """Sample ``j`` of the group is the request ``keys[j]``, seeded ``request_seed(seed, j)``
        (with the prompt's images, for a VL policy)."""
        t = self.train_set
        prompt, images = t.prompts[row], (t.images[row] if t.images else None)
        return [SampleWork(key, prompt, dataclasses.replace(self.sampling, n=1, seed=request_seed(seed, j)), images)
                for j, key in enumerate(keys)]

    def score(self, row: int, outputs: list) -> RewardBatch:
        t = self.train_set
        rb = self.scorer.score([o.token_ids for o in outputs], [t.answers[row]] * len(outputs),
                               [t.prompt_texts[row]] * len(outputs))
        rb.token_scores = _teacher_scores(self.teacher, lambda: rollouts_from_outputs(outputs, self.pad_id))
        return rb

    def assemble(self, rows: list[int], outputs: list[list], rewards: list[RewardBatch],
                 device: torch.device) -> StepBatch:
        ro = rollouts_to_device(rollouts_from_outputs([o for group in outputs for o in group], self.pad_id), device)
        if self.vision is not None:  # a sampled vision token: never a placeholder, never trained
            keep = vision_token_response_mask(ro.input_ids, torch.tensor(ro.prompt_lengths, device=device), self.vision)
            ro.response_mask *= keep[:, None]
        sb = StepBatch.from_groups(rows, self.n, ro)
        _set_rewards(sb, RewardBatch.concat(rewards))
        return sb


class EpisodeGroups:
    kind = "agent episodes"

    def __init__(self, train_set, scorer, *, n: int, pad_id: int, reward_reads: str | None, discount: float,
                 failure_reward: float, teacher=None):
        """``reward_reads``: a tools class's episodes are scored by the run's reward on their
        ``"final_answer"`` or their ``"transcript"`` (everything after the opening prompt, tool
        messages included: what an LLM judge of whole episodes reads); None: an environment
        class, whose turn rewards are the outcome."""
        self.train_set, self.scorer, self.n, self.pad_id = train_set, scorer, n, pad_id
        self.reward_reads = reward_reads
        self.discount, self.failure_reward = discount, failure_reward
        self.teacher = teacher  # a trainer.teacher.Teacher, or None

    def work(self, row: int, seed: int, keys: list[str]) -> list[EpisodeWork]:
        """Episode ``j`` is ``keys[j]``, seeded ``request_seed(seed, j)`` (turn k: mixed with k)."""
        t = self.train_set
        data = {"prompt": t.prompt_texts[row], "answer": t.answers[row]}
        return [EpisodeWork(key, data, request_seed(seed, j)) for j, key in enumerate(keys)]

    def score(self, row: int, trajs: list[Trajectory]) -> RewardBatch:
        failures: Counter = Counter()
        for t in trajs:
            t.outcome = _discounted(t.turn_rewards, self.discount)
        transcript = self.reward_reads == "transcript"
        answered = [t for t in trajs if t.status != "failed" and (transcript or t.final_answer is not None)]
        if self.reward_reads is not None and answered:
            t = self.train_set
            texts = ([self.scorer.tokenizer.decode(e.ids[len(e.prompt_ids):]) for e in answered] if transcript
                     else [e.final_answer for e in answered])
            rb = self.scorer.runner.score(texts, [t.answers[row]] * len(answered),
                                          [str(t.prompt_texts[row])] * len(answered))
            failures.update(rb.failures)
            for e, s in zip(answered, rb.scores):
                e.outcome += s
        failed = sum(t.status == "failed" for t in trajs)
        if failed:
            failures["episode failed"] += failed
        return RewardBatch(scores=[self.failure_reward if t.status == "failed" else t.outcome for t in trajs],
                           failures=failures,
                           token_scores=_teacher_scores(self.teacher, lambda: trajectories_to_rollouts(trajs, self.pad_id)))

    def assemble(self, rows: list[int], outputs: list[list[Trajectory]], rewards: list[RewardBatch],
                 device: torch.device) -> StepBatch:
        trajs = [t for group in outputs for t in group]
        ro = trajectories_to_rollouts(trajs, self.pad_id)
        scored = ro.response_mask.bool().to(device)  # what the teacher scored, failed episodes included
        index = []
        for b, t in enumerate(trajs):
            if t.status == "failed":  # alone in its group, nothing trained
                index.append(len(rows) + b)
                ro.response_mask[b] = 0.0
            else:
                index.append(b // self.n)
        sb = StepBatch.from_rollouts(rows, index, rollouts_to_device(ro, device))
        _set_rewards(sb, RewardBatch.concat(rewards), scored)
        sb.episode_metrics = episode_metrics(trajs)
        return sb


def _teacher_scores(teacher, rows) -> list[list[float]] | None:
    """The teacher's log-prob of every response token of the group's rows (``rows()``: their
    ``Rollouts``), per row in order; None without a teacher."""
    if teacher is None:
        return None
    ro = rows()
    lp = teacher.log_probs(ro.input_ids, ro.attention_mask, ro.response_mask)
    inside = ro.response_mask.bool()
    return [lp[b][inside[b]].tolist() for b in range(lp.shape[0])]


def _set_rewards(sb: StepBatch, rb: RewardBatch, scored: torch.Tensor | None = None) -> None:
    """The group scores (and token scores) on the step batch; ``scored``: the mask the token
    scores were taken over, when it is not (any more) the rollouts' response mask."""
    if rb.token_scores is not None:  # row-major over the mask, as the rows were scored
        mask = scored if scored is not None else sb.rollouts.response_mask.bool()
        teacher = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        teacher[mask] = torch.tensor([x for row in rb.token_scores for x in row], dtype=torch.float32,
                                     device=mask.device)
        sb.tensors["teacher_log_prob"] = teacher
    sb.failures = sum(rb.failures.values())
    sb.extras = rb.extra_means()  # reward-reported fields (combined components, dict extras)
    sb.raw_scores = torch.tensor(rb.scores, dtype=torch.float32, device=sb.rollouts.input_ids.device)
    sb.scores = sb.raw_scores


def _discounted(rewards: list[float], discount: float) -> float:
    total = 0.0
    for r in reversed(rewards):
        total = r + discount * total
    return total
