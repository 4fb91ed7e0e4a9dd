"""What one reward call produced: a score with optional extra metrics, or why it failed.

A reward may return a number (``bool`` counts as 0/1; numpy scalars and 0-d tensors
are numbers too), or a dict ``{"score": number, **extras}`` whose extra numeric fields
are logged as metrics. Anything else, or a non-finite number, fails that sample. A
function may also ``raise RewardFailure("why")`` to fail a sample with its own reason.

A failure has a ``reason`` (counted, so it is short and stable: "raised ValueError") and a
``detail`` (logged once per reason by the runner: the message and where it was raised).

These helpers run wherever the reward runs (inline, or inside a worker process), so only
plain floats and strings ever cross a process boundary.
"""

from __future__ import annotations

import math
import numbers
import reprlib
import traceback
from typing import Any, Callable, NamedTuple

NON_NUMERIC = "non-numeric or non-finite result"
MEMORY_LIMIT = "memory limit"  # MemoryError: reward.memory_limit_mb (or the machine) ran out


class RewardFailure(Exception):
    """Raise from a reward (or put an instance in a batched reward's result list) to fail
    that sample; the message is the failure reason counted in ``RewardBatch.failures``."""

    def __init__(self, reason: str, detail: str | None = None):
        super().__init__(reason)
        self.detail = detail  # a longer explanation, logged once (e.g. a combined reward's component error)


class Outcome(NamedTuple):
    score: float | None  # None when the sample failed
    extras: dict[str, float] | None
    failure: str | None  # the reason, counted by the runner; None on success
    detail: str | None = None  # for a failure: the first line of the error and where it came from


def as_number(value: Any) -> float | None:
    """``value`` as a finite float, or None. Accepts bool, int, float, numpy scalars and
    0-d arrays/tensors (anything with ``.item()`` and ``ndim == 0``)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # numpy bool_/scalars, 0-d ndarray, 0-d torch.Tensor
    if not isinstance(value, numbers.Real):  # bool is Real; complex and str are not
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def failed(reason: str, detail: str | None = None) -> Outcome:
    return Outcome(None, None, reason, detail or reason)


def describe(error: BaseException) -> str:
    """The failure reason for an exception raised by (or returned from) a reward."""
    if isinstance(error, RewardFailure):
        return str(error)
    return MEMORY_LIMIT if isinstance(error, MemoryError) else f"raised {type(error).__name__}"


def explain(error: BaseException) -> str:
    """One line for the log: ``Type: message (file:line)`` of the innermost frame."""
    try:
        if isinstance(error, RewardFailure):
            return error.detail or str(error)
        lines = str(error).strip().splitlines()
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises
        lines = []
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    return f"{text} ({frames[-1].filename}:{frames[-1].lineno})" if frames else text


def _error_outcome(error: BaseException) -> Outcome:
    return failed(describe(error), explain(error))


def to_outcome(value: Any) -> Outcome:
    """Interpret what a reward returned for one sample (never raises: reading ``value``
    runs its code, ``.item()`` or ``__repr__``, which may)."""
    try:
        return _interpret(value)
    except Exception as e:  # noqa: BLE001
        return _error_outcome(e)


def _interpret(value: Any) -> Outcome:
    if isinstance(value, BaseException):
        return _error_outcome(value)
    if isinstance(value, dict):
        if "score" not in value:
            return failed("dict result without a 'score' key", f"returned {reprlib.repr(value)}")
        extras: dict[str, float] = {}
        for key, extra in value.items():
            if key == "score":
                continue
            number = as_number(extra)
            if not isinstance(key, str) or number is None:
                return failed(f"non-numeric or non-finite extra {key!r}", f"returned {reprlib.repr(value)}")
            extras[key] = number
        score = as_number(value["score"])
        return Outcome(score, extras, None) if score is not None else _non_numeric(value)
    score = as_number(value)
    return Outcome(score, None, None) if score is not None else _non_numeric(value)


def _non_numeric(value: Any) -> Outcome:
    return failed(NON_NUMERIC, f"returned {type(value).__name__} {reprlib.repr(value)}")


def call_one(fn: Callable, response: str, answer: Any, prompt: str) -> Outcome:
    """``fn(response, answer, prompt)`` as an Outcome; never raises (except Ctrl-C)."""
    try:
        value = fn(response, answer, prompt)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a bad sample costs that sample only
        return _error_outcome(e)
    return to_outcome(value)


def call_batch(fn: Callable, responses: list[str], answers: list, prompts: list[str]) -> list[Outcome]:
    """A batched ``fn(responses, answers, prompts) -> list`` as one Outcome per sample.
    A raise (or a result of the wrong length) fails the whole batch."""
    n = len(responses)
    try:
        values = fn(responses, answers, prompts)
    except (Exception, SystemExit) as e:  # noqa: BLE001
        return [_error_outcome(e)] * n
    try:
        values = list(values)
    except TypeError:
        return [failed("batched reward did not return a list", f"returned {reprlib.repr(values)}")] * n
    except Exception as e:  # noqa: BLE001 - a generator that raises while being listed
        return [_error_outcome(e)] * n
    if len(values) != n:
        return [failed(f"batched reward returned {len(values)} results for {n} samples")] * n
    return [to_outcome(v) for v in values]
