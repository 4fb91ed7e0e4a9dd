"""What every config group shares: the error type, the field helper, value checks.

Every field carries a one-line doc in ``metadata["help"]`` (``hybridrl train --help``), a
numeric one its bounds in ``metadata["check"]`` (a :class:`Range`, declared once with the
field and checked by :func:`check_ranges` from the group's ``__post_init__``).
Checks raise :class:`ConfigError`: one line naming the key, the problem and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from hybridrl.did_you_mean import suggest


class ConfigError(ValueError):
    """A user mistake in the configuration (one line: key, problem, fix)."""


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric field: finite and within ``[low, high]`` (``(low, high]`` with
    ``low_open``); ``hint`` ends the error message. ``Range()`` asks only for a finite number."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    hint: str = ""


def _f(default: Any, help: str, *, check: Range | None = None, **kw: Any) -> Any:
    metadata = {"help": help} if check is None else {"help": help, "check": check}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


def check_choice(value: Any, choices: Iterable[str], key: str) -> None:
    choices = list(choices)
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is unknown; {suggest(value, choices)}")


def check_number(value: float | int | None, key: str, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, hint: str = "") -> None:
    """Finite and within ``[low, high]`` (``(low, high]`` with ``low_open``); ``None`` passes."""
    if value is None:
        return
    # an int is finite however large (math.isfinite would overflow converting it to a float)
    ok = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        lo = "" if low is None else (f"> {low}" if low_open else f">= {low}")
        hi = "" if high is None else f"<= {high}"
        bound = " and ".join(b for b in (lo, hi) if b) or "finite"
        raise ConfigError(f"{key}={value}: must be a finite number {bound}{'; ' + hint if hint else ''}")


MAX_SEED = 2**63 - 1  # torch.manual_seed takes a 64-bit seed; random.Random(-s) draws as Random(s) does


SEED = Range(low=0, high=MAX_SEED, hint="a seed is an integer in 0 .. 2**63 - 1")  # every generator takes it as given


def check_ranges(group: Any, prefix: str) -> None:
    """:func:`check_number` on every field of the dataclass ``group`` declared with a
    :class:`Range`, in field order, keyed ``prefix.name``."""
    for f in fields(group):
        r = f.metadata.get("check")
        if r is not None:
            check_number(getattr(group, f.name), f"{prefix}.{f.name}", low=r.low, high=r.high,
                         low_open=r.low_open, hint=r.hint)
