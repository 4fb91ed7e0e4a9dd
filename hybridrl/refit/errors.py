"""The one user-facing error type of refit."""


class RefitError(ValueError):
    """A refit was rejected or failed a check; the message says what, where and how to fix."""


def listing(items, limit: int = 8) -> str:
    """``a, b, c (+N more)`` for error messages that name offending weights."""
    items = sorted(map(str, items))
    head = ", ".join(items[:limit])
    return head + (f" (+{len(items) - limit} more)" if len(items) > limit else "")
