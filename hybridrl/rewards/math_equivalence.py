"""MATH-style reward: the response's final (``\\boxed{}``) answer is mathematically
equivalent to the ground truth, judged by HuggingFace's ``math-verify`` package.

``math-verify`` (and the sympy it brings) is optional: it is imported on first use and
its absence is a one-line error naming the extra to install. Its own signal-based
timeouts are switched off: they only work on a process's main thread, and the runner's
worker processes already enforce ``reward.timeout_s`` by killing a stuck call. Parsing
untrusted LaTeX into sympy can take unbounded time, so this reward is not trusted: it
always runs in a worker process.
"""

from __future__ import annotations

import logging
from typing import Any

from hybridrl.rewards.outcome import RewardFailure
from hybridrl.rewards.registry import register_reward

INSTALL_HINT = "pip install 'hybridrl[math]'"
FORCE_MISSING = False  # tests flip this to check the error without uninstalling


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's "Timeout is disabled" warning: we disable it on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_QUIET = _NoTimeoutNotice()


def require_math_verify():
    """``(parse, verify)`` from math-verify, or an ImportError saying how to install it."""
    try:
        if FORCE_MISSING:
            raise ImportError("math_verify")
        from math_verify import parse, verify
    except ImportError:
        raise ImportError(f"the math_verify reward needs the math-verify package: {INSTALL_HINT}") from None
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_QUIET)  # idempotent
    return parse, verify


def _gold_text(answer: Any) -> str:
    # math-verify finds answers in $...$ or \boxed{}; a bare reference such as "\frac{1}{2}"
    # (the usual MATH answer column) needs the delimiters to be read as LaTeX
    text = str(answer).strip()
    return text if ("\\boxed" in text or "$" in text) else f"${text}$"


@register_reward("math_verify")
def math_verify(response: str, answer: Any, prompt: str = "") -> float:
    """1.0 when math-verify finds the response's answer equivalent to ``answer``, else 0.0."""
    parse, verify = require_math_verify()
    if answer is None:
        raise RewardFailure("math_verify: no ground-truth answer")
    gold = parse(_gold_text(answer), parsing_timeout=None)
    if not gold:
        raise RewardFailure("math_verify: could not parse the ground-truth answer")
    predicted = parse(response, parsing_timeout=None)
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=None))


def _warmup() -> None:
    """Import math-verify (and sympy) once per worker, before timed calls start."""
    parse, _ = require_math_verify()
    parse("$1$", parsing_timeout=None)


math_verify.hybridrl_warmup = _warmup
