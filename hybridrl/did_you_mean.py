"""The one "did you mean" helper: every unknown name (config key, algorithm, reward) is
reported the same way, with the nearest valid choice or the list of choices.

A leaf module (standard library only) so that every layer, ``algos`` included, may use it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def suggest(value: object, choices: Iterable[str], *, prefix: str = "", quote: bool = True) -> str:
    """``"did you mean 'x'?"`` for the closest choice, else ``"valid: 'a', 'b'"``.

    ``quote=False`` with a ``prefix`` names config keys (``did you mean trainer.total_steps?``)."""
    choices = [str(c) for c in choices]
    close = difflib.get_close_matches(str(value), choices, n=1)
    show = (lambda c: repr(prefix + c)) if quote else (lambda c: prefix + c)
    if close:
        return f"did you mean {show(close[0])}?"
    return "valid: " + ", ".join(show(c) for c in sorted(choices))


def check_choice(value: object, choices: Iterable[str], key: str, kind: str) -> None:
    """Raise a one-line ``ValueError`` (``key=value: unknown kind; did you mean ...``)
    unless ``value`` is one of ``choices``."""
    choices = list(choices)
    if value in choices:
        return
    raise ValueError(f"{key}={value!r}: unknown {kind}; {suggest(value, choices)}")
