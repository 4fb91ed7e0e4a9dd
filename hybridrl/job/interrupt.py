"""SIGINT / SIGTERM during training: finish the current step, save, exit with one line.

The handler only sets a flag (a signal can land anywhere, e.g. inside a refit whose
order must complete); the loop checks it between steps. A second signal restores the
default behaviour, so an impatient user can still kill the process at once.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class TrainingInterrupted(Exception):
    """Raised by the loop after the checkpoint for an interrupt has been written."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class InterruptFlag:
    """Context manager installing the handlers (main thread only; elsewhere a no-op)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        for sig, handler in self._previous.items():  # a second signal acts at once
            signal.signal(sig, handler)

    def __enter__(self) -> "InterruptFlag":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
