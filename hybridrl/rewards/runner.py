"""Run a reward function over a batch so that one bad sample costs that sample only.

A call that raises, returns a non-number (or NaN / inf), or runs past ``timeout_s``
(measured from when that call started, not from the batch start) scores
``failure_reward`` and is counted in the batch's ``failures``.

User functions run on daemon worker threads. Python cannot kill a thread, so a hung
call is abandoned: its worker is replaced, and being a daemon it never blocks process
exit. Trusted built-ins (pure, bounded: ``register_reward(..., trusted=True)``) run
inline, which saves the thread hop.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

_POLL_S = 0.02


@dataclass
class RewardBatch:
    scores: list[float]
    failures: Counter = field(default_factory=Counter)
    seconds: float = 0.0


class _Worker(threading.Thread):
    """Daemon thread running jobs ``(i, fn, args)`` and recording start times and results."""

    def __init__(self, jobs: queue.Queue, started: dict, results: dict):
        super().__init__(daemon=True, name="hybridrl-reward")
        self.jobs, self.started, self.results = jobs, started, results
        self.abandoned = False

    def run(self) -> None:
        while not self.abandoned:
            try:
                i, call = self.jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            self.started[i] = time.monotonic()
            self.results[i] = call()


class RewardRunner:
    def __init__(self, fn: Callable[[str, Any, str], float], *, timeout_s: float = 10.0,
                 workers: int = 4, failure_reward: float = 0.0):
        self.fn = fn
        self.timeout_s = timeout_s
        self.workers = workers
        self.failure_reward = failure_reward
        self.total_failures: Counter = Counter()

    def _call(self, response: str, answer: Any, prompt: str) -> tuple[float | None, str | None]:
        try:
            value = self.fn(response, answer, prompt)
        except Exception as e:  # noqa: BLE001 - any user error costs only this sample
            return None, f"raised {type(e).__name__}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None, "non-numeric or non-finite result"
        return float(value), None

    def score(self, responses: list[str], answers: list[Any], prompts: list[str]) -> RewardBatch:
        t0 = time.perf_counter()
        if getattr(self.fn, "hybridrl_trusted", False):
            outcomes = [self._call(r, a, p) for r, a, p in zip(responses, answers, prompts)]
        else:
            outcomes = self._run_threaded(list(zip(responses, answers, prompts)))
        batch = RewardBatch(scores=[])
        for value, why in outcomes:
            if why is not None:
                batch.failures[why] += 1
                value = self.failure_reward
            batch.scores.append(value)
        self.total_failures.update(batch.failures)
        batch.seconds = time.perf_counter() - t0
        return batch

    def _run_threaded(self, items: list[tuple[str, Any, str]]) -> list[tuple[float | None, str | None]]:
        jobs: queue.Queue = queue.Queue()
        started: dict[int, float] = {}
        results: dict[int, tuple] = {}
        for i, (r, a, p) in enumerate(items):
            jobs.put((i, lambda r=r, a=a, p=p: self._call(r, a, p)))
        workers = [_Worker(jobs, started, results) for _ in range(min(self.workers, len(items)) or 1)]
        for w in workers:
            w.start()
        timed_out: set[int] = set()
        while len(results) + len(timed_out) < len(items):
            time.sleep(_POLL_S)
            now = time.monotonic()
            for i, t in list(started.items()):
                if i not in results and i not in timed_out and now - t > self.timeout_s:
                    timed_out.add(i)
                    # that worker is stuck in call i: let it go and add a fresh one
                    w = _Worker(jobs, started, results)
                    w.start()
                    workers.append(w)
        for w in workers:
            w.abandoned = True  # idle workers exit; a stuck one dies with the process
        return [(None, "timeout") if i in timed_out else results[i] for i in range(len(items))]

    def close(self) -> None:
        """Nothing to release: workers are per batch and daemonic (kept for API symmetry)."""
