"""What makes generation settings valid, in one place: the engines' ``SamplingParams`` and
the run's ``rollout.*`` both ask :func:`sampling_problem` (and name the fields their way)."""

from __future__ import annotations


def sampling_problem(*, temperature: float, top_k: int, top_p: float, max_tokens: int, n: int) -> str | None:
    """``"<field>=<value> must ..."`` for the first invalid setting, or None."""
    if temperature < 0:
        return f"temperature={temperature} must be >= 0 (0 = greedy)"
    if not 0.0 < top_p <= 1.0:
        return f"top_p={top_p} must be in (0, 1]"
    if top_k < -1:
        return f"top_k={top_k} must be -1 (off) or >= 1"
    if max_tokens < 1:
        return f"max_tokens={max_tokens} must be >= 1"
    if n < 1:
        return f"n={n} must be >= 1"
    return None
