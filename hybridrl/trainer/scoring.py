"""Scoring responses: decode with the tokenizer, run the reward, and the one greedy
evaluation that both held-out eval and the ReMax baseline use."""

from __future__ import annotations

import threading
from typing import Any

from hybridrl.rewards import RewardBatch, RewardRunner
from hybridrl.trainer.prompts import PromptSet
from hybridrl.trainer.rollout_worker import RolloutWorker


class RewardScorer:
    """``RewardRunner`` over decoded response tokens. Thread-safe: one batch at a time (an
    overlapped run scores finished groups on the pipeline's thread while the main thread
    may score an eval; the runner's pool and failure breaker serve one caller at a time)."""

    def __init__(self, runner: RewardRunner, tokenizer: Any):
        self.runner, self.tokenizer = runner, tokenizer
        self._lock = threading.Lock()

    def score(self, response_token_ids: list[list[int]], answers: list[Any], prompt_texts: list[str]) -> RewardBatch:
        texts = self.tokenizer.batch_decode(response_token_ids, skip_special_tokens=True)
        with self._lock:
            return self.runner.score(texts, answers, prompt_texts)

    def close(self) -> None:
        self.runner.close()


def greedy_scores(rollout: RolloutWorker, scorer: RewardScorer, prompts: PromptSet) -> list[float]:
    """The reward of each prompt's greedy response (held-out eval; ReMax's baseline)."""
    out = rollout.greedy(prompts.prompts, prompts.images)
    return scorer.score(out.response_token_ids, prompts.answers, prompts.prompt_texts).scores
