"""The episode driver's calls to its environment pool: batched, timed, and optionally on a
background thread so that tools run while the engine decodes.

``EnvCaller.run(calls)`` makes the fewest pool calls that keep each episode's calls in
order: consecutive calls of distinct episodes form one segment, run as one ``end`` each,
one ``reset`` of all resets and one ``step`` of all steps (the pool runs an episode's
batch concurrently). ``EnvThread`` runs ``EnvCaller.run`` on one thread — the pool is not
thread-safe, so every pool call goes through it — batching whatever was queued while it
was busy. A pool call that raises (a closed pool, a misused id) is an error of the
driver, not of an episode: it is handed back for the driver to raise.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from hybridrl.agents.types import EnvStep

RESET, STEP, END, ERROR = "reset", "step", "end", "error"


@dataclass(frozen=True)
class EnvCall:
    kind: str
    """"reset" (arg: the row), "step" (arg: the assistant text) or "end" (arg: None)."""
    episode_id: str
    arg: Any
    key: int
    """the driver's serial number of the episode (a late result of an ended episode whose id
    was reused is told apart by it)."""


@dataclass(frozen=True)
class EnvEvent:
    """An environment result the driver applied: what a lockstep leader broadcasts (picklable)."""

    episode_id: str
    kind: str
    """"reset" or "step" ("error": the leader's pool call raised; ``step.failure`` says what)."""
    step: EnvStep
    seconds: float
    """the pool call's wall time, shared evenly by the episodes it served."""


class EnvCaller:
    """Runs batches of ``EnvCall`` on ``pool``; every reset / step pool call lasts at least
    ``latency_s`` (a benchmark's stand-in for a remote environment). ``busy_s``: the wall time
    pool calls ran, in all."""

    def __init__(self, pool: Any, latency_s: float = 0.0):
        self.pool, self.latency_s, self.busy_s = pool, latency_s, 0.0

    def run(self, calls: list[EnvCall]) -> list[tuple[EnvCall, EnvStep, float]]:
        """(call, result, seconds) for each reset and step of ``calls``, resets of a segment first."""
        out, segment, seen = [], [], set()
        for call in calls:
            if call.episode_id in seen:  # its earlier call must finish first
                out += self._segment(segment)
                segment, seen = [], set()
            segment.append(call)
            seen.add(call.episode_id)
        return out + self._segment(segment)

    def _segment(self, calls: list[EnvCall]) -> list[tuple[EnvCall, EnvStep, float]]:
        for call in calls:
            if call.kind == END:
                self.pool.end(call.episode_id)
        resets = [c for c in calls if c.kind == RESET]
        steps = [c for c in calls if c.kind == STEP]
        out = []
        if resets:
            out += self._timed(resets, lambda: self.pool.reset([c.episode_id for c in resets], [c.arg for c in resets]))
        if steps:
            out += self._timed(steps, lambda: self.pool.step([(c.episode_id, c.arg) for c in steps]))
        return out

    def _timed(self, calls: list[EnvCall], fn) -> list[tuple[EnvCall, EnvStep, float]]:
        t0 = time.perf_counter()
        results = fn()
        if len(results) != len(calls):
            raise RuntimeError(f"the env pool returned {len(results)} results for {len(calls)} {calls[0].kind} "
                               "calls; it must return one per episode")
        rest = self.latency_s - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        seconds = time.perf_counter() - t0
        self.busy_s += seconds
        per = seconds / len(calls)
        return [(c, r, per) for c, r in zip(calls, results)]


@dataclass
class EnvBatch:
    """What one round of the env thread gave back."""

    calls: int
    """resets and steps it was handed (answered, or lost to ``error``)."""
    results: list[tuple[EnvCall, EnvStep, float]]
    error: BaseException | None = None


class EnvThread:
    """``caller.run`` on one daemon thread: ``submit`` calls, ``get`` finished batches."""

    def __init__(self, caller: EnvCaller):
        self.caller = caller
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._batches: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="hybridrl-env", daemon=True)
        self._thread.start()

    def submit(self, call: EnvCall) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("EpisodeDriver: its env thread is stopped (close() was called); build a new driver")
        self._calls.put(call)

    def get(self, timeout_s: float | None) -> EnvBatch | None:
        """A finished batch; None if none is ready within ``timeout_s`` (0: do not wait)."""
        try:
            return self._batches.get(timeout=timeout_s) if timeout_s else self._batches.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        """Finish what was submitted, then stop (idempotent)."""
        if self._thread.is_alive():
            self._calls.put(None)
            self._thread.join()

    def _loop(self) -> None:
        stop = False
        while not stop:
            batch = [self._calls.get()]
            while True:  # everything queued meanwhile joins this round
                try:
                    batch.append(self._calls.get_nowait())
                except queue.Empty:
                    break
            stop = any(c is None for c in batch)
            calls = [c for c in batch if c is not None]
            if not calls:
                continue
            answered = sum(c.kind != END for c in calls)
            try:
                self._batches.put(EnvBatch(answered, self.caller.run(calls)))
            except BaseException as e:  # noqa: BLE001 - handed to the driver, which raises it
                self._batches.put(EnvBatch(answered, [], e))
