"""How per-batch metrics combine over micro-batches, mini-batches and data-parallel ranks.

Most metrics are means (the callers weight and normalize them). The metrics in ``EXTREMES``
are a maximum (or minimum) over tokens and combine by ``max`` (``min``): the mean of
per-micro-batch maxima is no one's maximum.

Not (yet) in ``EXTREMES``: ``actor/ratio_max`` / ``actor/ratio_min`` and
``async/is_weight_max`` / ``async/staleness_max`` are still the mean of their per-batch
(per-rank) extremes, as the golden recordings of every machine pin them; moving them here is
a re-recording of those goldens on every machine kind.
"""
from __future__ import annotations

EXTREMES: dict[str, str] = {
    "rollout/trainer_logprob_abs_diff_max": "max",
}


def extreme(key: str) -> str | None:
    """``"max"``, ``"min"`` or None (a mean) for metric ``key``."""
    return EXTREMES.get(key)


def is_extreme(key: str) -> bool:
    return key in EXTREMES


def accumulate(into: dict[str, float], metrics: dict[str, float]) -> None:
    """Add ``metrics`` into the running ``into`` (sums for means, max / min for extremes)."""
    for key, value in metrics.items():
        kind = extreme(key)
        if key not in into:
            into[key] = value
        elif kind == "max":
            into[key] = max(into[key], value)
        elif kind == "min":
            into[key] = min(into[key], value)
        else:
            into[key] += value
