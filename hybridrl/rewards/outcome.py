"""What one reward call produced: a score with optional extra metrics, or why it failed.

A reward may return a number (``bool`` counts as 0/1; numpy scalars and 0-d tensors
are numbers too), or a dict ``{"score": number, **extras}`` whose extra numeric fields
are logged as metrics. Anything else, or a non-finite number, fails that sample. A
function may also ``raise RewardFailure("why")`` to fail a sample with its own reason.

These helpers run wherever the reward runs (inline, or inside a worker process), so only
plain floats and strings ever cross a process boundary.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, NamedTuple

NON_NUMERIC = "non-numeric or non-finite result"


class RewardFailure(Exception):
    """Raise from a reward (or put an instance in a batched reward's result list) to fail
    that sample; the message is the failure reason counted in ``RewardBatch.failures``."""


class Outcome(NamedTuple):
    score: float | None  # None when the sample failed
    extras: dict[str, float] | None
    failure: str | None  # the reason, counted by the runner; None on success


def as_number(value: Any) -> float | None:
    """``value`` as a finite float, or None. Accepts bool, int, float, numpy scalars and
    0-d arrays/tensors (anything with ``.item()`` and ``ndim == 0``)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # numpy bool_/scalars, 0-d ndarray, 0-d torch.Tensor
    if not isinstance(value, numbers.Real):  # bool is Real; complex and str are not
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def failed(reason: str) -> Outcome:
    return Outcome(None, None, reason)


def describe(error: BaseException) -> str:
    """The failure reason for an exception raised by (or returned from) a reward."""
    return str(error) if isinstance(error, RewardFailure) else f"raised {type(error).__name__}"


def to_outcome(value: Any) -> Outcome:
    """Interpret what a reward returned for one sample."""
    if isinstance(value, BaseException):
        return failed(describe(value))
    if isinstance(value, dict):
        if "score" not in value:
            return failed("dict result without a 'score' key")
        extras: dict[str, float] = {}
        for key, extra in value.items():
            if key == "score":
                continue
            number = as_number(extra)
            if not isinstance(key, str) or number is None:
                return failed(f"non-numeric or non-finite extra {key!r}")
            extras[key] = number
        score = as_number(value["score"])
        return Outcome(score, extras, None) if score is not None else failed(NON_NUMERIC)
    score = as_number(value)
    return Outcome(score, None, None) if score is not None else failed(NON_NUMERIC)


def call_one(fn: Callable, response: str, answer: Any, prompt: str) -> Outcome:
    """``fn(response, answer, prompt)`` as an Outcome; never raises (except Ctrl-C)."""
    try:
        value = fn(response, answer, prompt)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a bad sample costs that sample only
        return failed(describe(e))
    return to_outcome(value)


def call_batch(fn: Callable, responses: list[str], answers: list, prompts: list[str]) -> list[Outcome]:
    """A batched ``fn(responses, answers, prompts) -> list`` as one Outcome per sample.
    A raise (or a result of the wrong length) fails the whole batch."""
    n = len(responses)
    try:
        values = fn(responses, answers, prompts)
    except (Exception, SystemExit) as e:  # noqa: BLE001
        return [failed(describe(e))] * n
    try:
        values = list(values)
    except TypeError:
        return [failed("batched reward did not return a list")] * n
    if len(values) != n:
        return [failed(f"batched reward returned {len(values)} results for {n} samples")] * n
    return [to_outcome(v) for v in values]
