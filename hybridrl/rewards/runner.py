"""Score a batch with a reward so that one bad sample costs that sample only.

A call that raises (``SystemExit`` included), returns a non-number (or NaN / inf), runs
past ``timeout_s`` (measured from when that call started, not from the batch start), or
kills its worker process scores ``failure_reward`` and is counted in the batch's
``failures`` under its reason ("timeout", "worker died", "raised ValueError", ...).

Trusted built-ins (pure and bounded: ``register_reward(..., trusted=True)``) run inline,
which saves the process hop. Everything else runs in a persistent pool of worker
processes (``process_pool.py``), which can kill a call that hangs even while holding the
GIL. A batched reward (``fn.hybridrl_batched``) is called once per batch, the timeout
applying to that whole call, in a pool of one worker; if it fails, every sample of the batch fails.

A reward whose recent calls (nearly) all fail is broken, not unlucky: once at least
``stop_rule.max_failure_rate`` of the last ``stop_rule.window`` calls failed,
:class:`RewardBrokenError` stops the batch (and the run) with one line (``breaker.py``);
``max_failure_rate=None`` never stops. For a batched reward every sample of a failed batch counts as one call.

Failures are counted, and the first one of each reason in the runner's life is reported
once, with its message and where it was raised (``first_errors``, and the ``report``
callback: by default a ``logging`` warning), so a reward that raises on every sample
says why once instead of a thousand times or never. Workers' stdout/stderr go to
``worker_output`` (a file) or /dev/null; ``memory_limit_mb`` caps each worker's memory
(a sample past it fails as "memory limit").
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from hybridrl.rewards.breaker import FailureBreaker, StopRule
from hybridrl.rewards.outcome import Outcome, call_batch, call_one, failed
from hybridrl.rewards.process_pool import TIMEOUT, Lost, ProcessPool
from hybridrl.rewards.registry import RewardFn, is_batched, is_trusted, reward_label
from hybridrl.rewards.spec import build_reward
from hybridrl.rewards.worker import dumps_for_worker

log = logging.getLogger(__name__)


@dataclass
class RewardBatch:
    scores: list[float]  # [B], failure_reward where a sample failed
    failures: Counter = field(default_factory=Counter)  # reason -> samples
    seconds: float = 0.0
    # extra metrics a reward reported (components of a combined reward, dict fields): per
    # sample [B], NaN where that sample failed or did not report the key
    extras: dict[str, list[float]] = field(default_factory=dict)
    # per sample, one value per response token in order (an on-policy distillation teacher's
    # log-probs of the sampled tokens); None when nothing scores tokens
    token_scores: list[list[float]] | None = None

    @classmethod
    def concat(cls, batches: list["RewardBatch"]) -> "RewardBatch":
        """The batches' samples in order, as one batch (extras a batch lacks are NaN there;
        token scores all or none)."""
        out = cls(scores=[s for b in batches for s in b.scores])
        if batches and all(b.token_scores is not None for b in batches):
            out.token_scores = [t for b in batches for t in b.token_scores]
        for b in batches:
            out.failures.update(b.failures)
            out.seconds += b.seconds
        start = 0
        for b in batches:
            for key, values in b.extras.items():
                out.extras.setdefault(key, [math.nan] * len(out.scores))[start:start + len(values)] = values
            start += len(b.scores)
        return out

    def extra_means(self) -> dict[str, float]:
        """Mean of each extra over the samples that reported it (NaNs skipped)."""
        means = {}
        for key, values in self.extras.items():
            reported = [v for v in values if not math.isnan(v)]
            if reported:
                means[key] = math.fsum(reported) / len(reported)
        return means


class RewardRunner:
    """Runs ``fn`` over batches: ``fn`` is a reward callable, or a spec that
    :func:`build_reward` understands (``"gsm8k"``, ``"path/to/file.py:fn"``,
    ``"module:fn"``, or a list of ``{name, weight, ...}``). Call ``close()`` when done."""

    def __init__(self, fn: RewardFn | str | Sequence[Mapping[str, Any]], *, timeout_s: float = 10.0,
                 workers: int = 4, failure_reward: float = 0.0, memory_limit_mb: int | None = None,
                 worker_output: str | os.PathLike | None = None, report: Callable[[str], None] | None = None,
                 stop_rule: StopRule = StopRule()):
        if not (_is_finite(timeout_s) and timeout_s > 0):  # NaN would switch the timeout off
            raise ValueError(f"reward.timeout_s={timeout_s!r}: must be a finite number of seconds > 0")
        if not (_is_int(workers) and workers >= 1):
            raise ValueError(f"reward.workers={workers!r}: must be an integer >= 1")
        if not _is_finite(failure_reward):
            raise ValueError(f"reward.failure_reward={failure_reward!r}: must be a finite number")
        if memory_limit_mb is not None and not (_is_int(memory_limit_mb) and memory_limit_mb >= 1):
            raise ValueError(f"reward.memory_limit_mb={memory_limit_mb!r}: must be an integer >= 1 (MB), "
                             "or null for no limit")
        self.fn = build_reward(fn)
        self.breaker = FailureBreaker(f"reward {reward_label(self.fn)!r}", window=stop_rule.window,
                                      max_failure_rate=stop_rule.max_failure_rate, fix=self._advice)
        self.timeout_s = float(timeout_s)
        self.workers = workers
        self.failure_reward = float(failure_reward)
        self.total_failures: Counter = Counter()
        self.first_errors: dict[str, str] = {}  # reason -> detail of its first occurrence
        self._report = report if report is not None else log.warning
        # one score() at a time: an async run's reward thread and the evaluation on the main
        # thread share this runner, and its worker pool and breaker are not thread-safe
        # (two at once: "ValueError: <_Worker> is not in list" or a hang in poll)
        self._scoring = threading.Lock()
        self._pool: ProcessPool | None = None
        if is_trusted(self.fn):
            warmup = getattr(self.fn, "hybridrl_warmup", None)
            if warmup is not None:
                warmup()
        else:
            # a batched reward is one call per batch: more workers would only idle, each holding
            # its own copy of whatever it loaded (a reward model, a judge's client)
            self._pool = _start_pool(self.fn, 1 if is_batched(self.fn) else workers, memory_limit_mb, worker_output)

    @classmethod
    def from_config(cls, reward, report: Callable[[str], None] | None = None) -> RewardRunner:
        """From a ``RewardConfig`` (``cfg.reward``)."""
        return cls(reward.spec, timeout_s=reward.timeout_s, workers=reward.workers,
                   failure_reward=reward.failure_reward, memory_limit_mb=reward.memory_limit_mb, report=report,
                   stop_rule=StopRule(window=reward.failure_window, max_failure_rate=reward.max_failure_rate))

    def score(self, responses: list[str], answers: list[Any], prompts: list[str]) -> RewardBatch:
        """Scores ``[B]`` for ``B`` (response, answer, prompt) triples."""
        if not len(responses) == len(answers) == len(prompts):
            raise ValueError(f"RewardRunner.score: {len(responses)} responses, {len(answers)} answers and "
                             f"{len(prompts)} prompts; pass one of each per sample")
        with self._scoring:
            t0 = time.perf_counter()
            outcomes = self._outcomes(list(responses), list(answers), list(prompts)) if responses else []
            batch = self._collect(outcomes)
            batch.seconds = time.perf_counter() - t0
        return batch

    def _outcomes(self, responses: list[str], answers: list, prompts: list[str]) -> list[Outcome]:
        batched = is_batched(self.fn)
        if self._pool is None:
            if batched:
                return self._judged(call_batch(self.fn, responses, answers, prompts))
            return [self._judge(call_one(self.fn, r, a, p)) for r, a, p in zip(responses, answers, prompts)]
        if batched:
            (result,) = self._pool.map(call_batch, [(responses, answers, prompts)], self.timeout_s)
            outcomes = [failed(result.reason, result.detail)] * len(responses) if isinstance(result, Lost) else result
            return self._judged(outcomes)
        results = self._pool.map(call_one, list(zip(responses, answers, prompts)), self.timeout_s,
                                 on_result=lambda _, r: self._judge(_as_outcome(r)))
        return [_as_outcome(r) for r in results]

    def _advice(self, failed: Counter) -> str:
        """What to do about a broken reward, by how its calls failed."""
        slow = f"raise reward.timeout_s (now {self.timeout_s:g} s) if it is only slow, or " if failed[TIMEOUT] else ""
        return (f"{slow}fix the reward (its first error is reported above); "
                f"reward.max_failure_rate={self.breaker.max_failure_rate} over reward.failure_window="
                f"{self.breaker.window} calls decides this stop, null turns it off")

    def _judge(self, outcome: Outcome) -> Outcome:
        """Feed one call's outcome to the breaker (raises RewardBrokenError when broken)."""
        self.breaker.record(outcome.failure, outcome.detail or "")
        return outcome

    def _judged(self, outcomes: list[Outcome]) -> list[Outcome]:
        for outcome in outcomes:
            self._judge(outcome)
        return outcomes

    def _collect(self, outcomes: list[Outcome]) -> RewardBatch:
        batch = RewardBatch(scores=[])
        for i, outcome in enumerate(outcomes):
            if outcome.failure is not None:
                batch.failures[outcome.failure] += 1
                batch.scores.append(self.failure_reward)
                self._first_error(outcome.failure, outcome.detail or outcome.failure)
                continue
            batch.scores.append(outcome.score)
            for key, value in (outcome.extras or {}).items():
                batch.extras.setdefault(key, [math.nan] * len(outcomes))[i] = value
        self.total_failures.update(batch.failures)
        return batch

    def _first_error(self, reason: str, detail: str) -> None:
        if reason not in self.first_errors:
            self.first_errors[reason] = detail
            self._report(f"reward {reward_label(self.fn)!r} failed a sample ({reason}): {detail}; "
                         f"further '{reason}' failures are only counted (reward/failures)")

    def close(self) -> None:
        """Stop the worker processes (idempotent; also done at exit and on garbage collection)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_outcome(result: Outcome | Lost) -> Outcome:
    return failed(result.reason, result.detail) if isinstance(result, Lost) else result


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_finite(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _start_pool(fn: RewardFn, workers: int, memory_limit_mb: int | None,
                output: str | os.PathLike | None) -> ProcessPool:
    try:
        return ProcessPool(_payload(fn), workers=workers, memory_limit_mb=memory_limit_mb, output=output)
    except RuntimeError as e:  # the reward loads here but not in a fresh process (or too slowly)
        raise ValueError(str(e)) from e


def _payload(fn: RewardFn) -> bytes:
    try:
        return dumps_for_worker(fn)
    except Exception as e:  # noqa: BLE001 - PicklingError, or AttributeError for local objects
        why = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"reward {reward_label(fn)!r} cannot be sent to a worker process ({type(e).__name__}: "
                         f"{why}); define it at module level in an importable file and pass "
                         f"'path/to/file.py:fn' or 'module:fn'") from None
