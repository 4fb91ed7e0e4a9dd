"""The one user-facing error type of refit."""

from hybridrl.rollout.backend import listing

__all__ = ["RefitError", "listing"]


class RefitError(ValueError):
    """A refit was rejected or failed a check; the message says what, where and how to fix."""
