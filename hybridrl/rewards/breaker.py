"""Stop a run whose reward is broken: nearly every recent call failed.

Per-sample isolation (a failed call scores ``failure_reward``, counted) is right for a
reward that fails now and then. For one that fails *every* call it is the wrong
judgement: each failure costs its timeout plus a worker respawn, a held-out eval alone
makes thousands of calls, and a 2-step run becomes half an hour of silence that trains
on constant rewards. So the runner keeps the outcomes of the last ``window`` calls, and
once that window is full and at least ``max_failure_rate`` of it failed, it raises
:class:`RewardBrokenError`, in the middle of a batch, with one line that says how many
calls failed, how, and what to do.

Why a window rather than a life-long rate: a reward that worked for 10,000 calls and
then breaks (a verifier service gone) is caught within ``window`` calls, and a reward
that fails one call in four never is (the chance that 22 of 24 such calls fail is about
1e-11).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

DEFAULT_WINDOW = 24
DEFAULT_MAX_FAILURE_RATE = 0.9


@dataclass(frozen=True)
class StopRule:
    """When a reward counts as broken: ``max_failure_rate`` of the last ``window`` calls
    failed (``max_failure_rate=None``: never)."""

    window: int = DEFAULT_WINDOW
    max_failure_rate: float | None = DEFAULT_MAX_FAILURE_RATE

    def __post_init__(self) -> None:
        rate = self.max_failure_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1):
            raise ValueError(f"reward.max_failure_rate={rate!r}: must be in (0, 1], or null to never stop")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"reward.failure_window={self.window!r}: must be an integer >= 1 (calls)")


class RewardBrokenError(ValueError):
    """The reward failed (nearly) every recent call; the run stops (a user error: one line)."""


class FailureBreaker:
    """Trips when ``window`` consecutive recorded calls hold >= ``max_failure_rate`` failures.

    ``max_failure_rate=None`` never trips. ``what`` names the reward in the message;
    ``fix(failures by reason)`` is the advice appended to it."""

    def __init__(self, what: str, *, window: int = DEFAULT_WINDOW,
                 max_failure_rate: float | None = DEFAULT_MAX_FAILURE_RATE,
                 fix: Callable[[Counter], str] = lambda failed: "fix it"):
        self.what, self.window, self.max_failure_rate, self.fix = what, window, max_failure_rate, fix
        self._recent: deque[str | None] = deque(maxlen=window)  # failure reason, or None for a success
        self._details: dict[str, str] = {}  # reason -> first line of its latest detail

    def record(self, reason: str | None, detail: str = "") -> None:
        """One call's outcome: ``reason`` of its failure, or None. Raises when broken."""
        self._recent.append(reason)
        if reason is not None:
            self._details[reason] = (detail.strip().splitlines() or [""])[0]
        if self.max_failure_rate is None or len(self._recent) < self.window:
            return
        failed = Counter(r for r in self._recent if r is not None)
        if sum(failed.values()) >= self.max_failure_rate * self.window:
            raise RewardBrokenError(self._message(failed))

    def _message(self, failed: Counter) -> str:
        how = "; ".join(f"{n} {reason}" + (f" ({self._details[reason]})" if self._details.get(reason) else "")
                        for reason, n in failed.most_common())
        return (f"{self.what} is broken: {sum(failed.values())} of its last {self.window} calls failed: {how}. "
                f"Stopped before spending more calls on it; {self.fix(failed)}")
