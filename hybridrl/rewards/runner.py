"""Run a reward function over a batch so that one bad sample costs that sample only.

A call that raises, returns a non-number (or NaN), or runs past ``timeout_s`` scores
``failure_reward`` and is counted in the batch's ``failures``. Calls run in a thread
pool; Python cannot kill a hung thread, so a timed-out call is abandoned (left to run
as a daemon) and the pool is replaced so that it cannot block later batches.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class RewardBatch:
    scores: list[float]
    failures: Counter = field(default_factory=Counter)
    seconds: float = 0.0


class RewardRunner:
    def __init__(self, fn: Callable[[str, Any, str], float], *, timeout_s: float = 10.0,
                 workers: int = 4, failure_reward: float = 0.0):
        self.fn = fn
        self.timeout_s = timeout_s
        self.workers = workers
        self.failure_reward = failure_reward
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        self.total_failures: Counter = Counter()

    def _call(self, response: str, answer: Any, prompt: str) -> tuple[float | None, str | None]:
        try:
            value = self.fn(response, answer, prompt)
        except Exception as e:  # noqa: BLE001 - any user error costs only this sample
            return None, f"raised {type(e).__name__}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            return None, "non-numeric result"
        return float(value), None

    def score(self, responses: list[str], answers: list[Any], prompts: list[str]) -> RewardBatch:
        if getattr(self.fn, "hybridrl_trusted", False):
            return self._score_inline(responses, answers, prompts)
        t0 = time.perf_counter()
        futures = [self._pool.submit(self._call, r, a, p) for r, a, p in zip(responses, answers, prompts)]
        done, not_done = wait(futures, timeout=self.timeout_s)
        batch = RewardBatch(scores=[])
        for fut in futures:
            if fut in not_done:
                batch.scores.append(self.failure_reward)
                batch.failures["timeout"] += 1
                continue
            value, why = fut.result()
            if why is not None:
                batch.failures[why] += 1
                value = self.failure_reward
            batch.scores.append(value)
        if not_done:
            # Abandon hung workers; a fresh pool keeps the next batch unblocked.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="reward")
        self.total_failures.update(batch.failures)
        batch.seconds = time.perf_counter() - t0
        return batch

    def _score_inline(self, responses, answers, prompts) -> RewardBatch:
        """Built-in verifiers are pure and bounded: no thread hop (it costs ~10 ms a batch)."""
        t0 = time.perf_counter()
        batch = RewardBatch(scores=[])
        for r, a, p in zip(responses, answers, prompts):
            value, why = self._call(r, a, p)
            if why is not None:
                batch.failures[why] += 1
                value = self.failure_reward
            batch.scores.append(value)
        self.total_failures.update(batch.failures)
        batch.seconds = time.perf_counter() - t0
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
