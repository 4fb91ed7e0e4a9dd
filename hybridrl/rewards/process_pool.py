"""A persistent pool of worker processes that run untrusted calls under a per-call timeout.

Why processes, not threads: a thread cannot be stopped, and a call that holds the GIL
(a catastrophic regex, a C extension loop) stalls the whole trainer past any timeout.
A process can be killed. So a call past its timeout gets its worker killed and replaced
(the call is ``Lost("timeout")``), and a worker that dies on its own (``os._exit``, a
segfault) costs the call it was running (``Lost("worker died")``) and is replaced.

Why ``subprocess`` rather than ``multiprocessing``: a worker must start from a clean
interpreter (a fork would copy the trainer's CUDA/torch state), and multiprocessing's
clean starts (spawn, forkserver) re-run the user's main script in every worker, which
without an ``if __name__ == "__main__"`` guard starts a second training run there. Our
worker runs ``python -c <boot>`` and imports only what the function needs; it gets the
trainer's ``sys.path`` so that what imports in the trainer imports in the worker (what
runs inside a worker, and how the function travels: ``worker.py``).

A worker's stdout and stderr go to ``output`` (a log file, appended to) or, by default,
to /dev/null: a reward that prints per sample must not flood the trainer's console. An
optional ``memory_limit_mb`` caps each worker's data memory (``worker.py``).

Startup is paid once: workers persist across ``map`` calls until ``close()``, garbage
collection or interpreter exit; on Linux the kernel also kills them if the trainer dies.
Each worker has its own socket, so killing one never corrupts a queue others share, and a
killed worker's late answer cannot reach anyone. Calls go out in chunks to amortize IPC;
the worker answers call by call, so the parent always knows which call is running and
since when: a timeout or death costs that one call, and the chunk's unstarted calls go
back to the queue.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Callable

TIMEOUT = "timeout"
WORKER_DIED = "worker died"
STARTUP_TIMEOUT_S = 120.0  # loading a reward may import sympy & co. on a loaded machine
MAX_CHUNK = 64  # calls per message: amortizes IPC without starving other workers
CHUNKS_PER_WORKER = 4  # smaller chunks near the end of a batch balance the load
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding hybridrl/
_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); from hybridrl.rewards.worker import worker_boot; "
         "worker_boot(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))")


@dataclass(frozen=True)
class Lost:
    """A call that produced no result: ``reason`` is TIMEOUT or WORKER_DIED; ``detail`` says more."""

    reason: str
    detail: str = ""


class _Worker:
    def __init__(self, process: subprocess.Popen, conn: Connection):
        self.process, self.conn = process, conn
        self.ready = False
        self.spawned = time.monotonic()
        self.calls: deque[int] = deque()  # indices of the sent chunk not yet answered
        self.started = 0.0  # when the call at calls[0] started (previous answer's arrival)
        self.gone = False  # its socket hit EOF: it exited

    def alive(self) -> bool:
        return not self.gone and self.process.poll() is None


def _kill(worker: _Worker) -> None:
    if worker.process.poll() is None:
        worker.process.kill()
    try:
        worker.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    worker.conn.close()


def _terminate(workers: list[_Worker], owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked copy of the trainer must not kill its workers
        return
    for worker in workers:
        _kill(worker)
    workers.clear()


class ProcessPool:
    """``workers`` processes running ``fn`` (pickled by :func:`worker.dumps_for_worker`).

    ``map(handler, calls, timeout_s)`` returns ``handler(fn, *args)`` for each ``args`` in
    ``calls`` (in order), or :class:`Lost` for a call that timed out or whose worker
    died. Not thread-safe: one ``map`` at a time, from a long-lived thread."""

    def __init__(self, payload: bytes, *, workers: int, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 output: str | os.PathLike | None = None, memory_limit_mb: int | None = None):
        self._payload = payload
        self._startup_timeout_s = startup_timeout_s
        self._output = output
        self._memory_limit_mb = memory_limit_mb or 0  # 0: no limit
        self._workers: list[_Worker] = []
        self._on_result: Callable[[int, object], None] | None = None  # map()'s, while it runs
        # runs on close(), garbage collection or interpreter exit; holds no reference to self
        self._finalizer = weakref.finalize(self, _terminate, self._workers, os.getpid())
        try:
            self._workers.extend(self._spawn() for _ in range(workers))
            while not all(w.ready for w in self._workers):
                wait([w.conn for w in self._workers if not w.gone], timeout=1.0)
                for worker in self._workers:
                    self._drain(worker, results=[])
                    self._check_starting(worker)
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Kill every worker (idempotent)."""
        self._finalizer()

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def _spawn(self) -> _Worker:
        ours, theirs = socket.socketpair()
        with theirs, self._open_output() as out:
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, _PACKAGE_ROOT, str(theirs.fileno()), str(os.getpid()),
                 str(self._memory_limit_mb)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        conn = Connection(ours.detach())
        conn.send((list(sys.path), self._payload))  # small: fits the socket buffer, never blocks
        return _Worker(process, conn)

    def _open_output(self):
        """Where a new worker's stdout and stderr go (the child keeps its own copy of the fd)."""
        return open(self._output, "ab") if self._output is not None else open(os.devnull, "wb")

    def _output_hint(self) -> str:
        return f"its output is in {self._output}" if self._output is not None else "its output went to /dev/null"

    def _check_starting(self, worker: _Worker) -> None:
        """Raise when a worker still loading the function died or is taking too long."""
        if worker.ready:
            return
        if not worker.alive():
            _kill(worker)  # reaps it, for the exit code
            raise RuntimeError(f"a reward worker exited ({_exit_status(worker.process.returncode)}) while loading "
                               f"the reward; {self._output_hint()}")
        if time.monotonic() - worker.spawned > self._startup_timeout_s:
            raise RuntimeError(f"a reward worker did not load the reward within {self._startup_timeout_s:.0f} s; "
                               f"check what importing it does")

    def _drain(self, worker: _Worker, results: list) -> int:
        """Read every message the worker has sent; returns how many calls it answered."""
        answered = 0
        try:
            while not worker.gone and worker.conn.poll():
                kind, value = worker.conn.recv()
                if kind == "error":
                    raise RuntimeError(f"reward worker could not load the reward: {value}")
                if kind == "ready":
                    worker.ready = True
                    continue
                assert worker.calls, "a worker answered a call it was not given"
                self._finish(results, worker.calls.popleft(), value)
                worker.started = time.monotonic()
                answered += 1
        except (EOFError, OSError):
            worker.gone = True  # it exited (or was killed); the caller replaces it
        return answered

    def _replace(self, worker: _Worker, reason: str, results: list, pending: deque, detail: str = "") -> int:
        """Kill ``worker``; its running call (if any) is Lost, the rest of its chunk goes back
        to the front of the queue. Returns how many calls were lost (0 or 1)."""
        _kill(worker)
        lost = 0
        if worker.calls:
            detail = detail or f"the worker process {_exit_status(worker.process.returncode)}; {self._output_hint()}"
            self._finish(results, worker.calls.popleft(), Lost(reason, detail))
            pending.extendleft(reversed(worker.calls))
            lost = 1
        self._workers[self._workers.index(worker)] = self._spawn()
        return lost

    def _dispatch(self, worker: _Worker, handler: Callable, calls: list, pending: deque, chunk: int) -> None:
        taken = [pending.popleft() for _ in range(min(chunk, len(pending)))]
        try:
            worker.conn.send((handler, [calls[i] for i in taken]))
        except OSError:  # BrokenPipeError: it died while idle, so nothing started
            pending.extendleft(reversed(taken))
            worker.gone = True
            return
        worker.calls.extend(taken)
        worker.started = time.monotonic()

    def map(self, handler: Callable, calls: list[tuple], timeout_s: float,
            on_result: Callable[[int, object], None] | None = None) -> list:
        """``handler(fn, *args)`` per call, in order, each within ``timeout_s`` or Lost.

        ``on_result(index, result)`` sees each result as it arrives; if it raises, the
        batch stops there (the pool is closed) and the exception propagates."""
        if self.closed:
            raise RuntimeError("the reward worker pool is closed; create a new RewardRunner")
        results: list = [None] * len(calls)
        pending = deque(range(len(calls)))
        chunk = max(1, min(MAX_CHUNK, len(calls) // (CHUNKS_PER_WORKER * len(self._workers))))
        remaining = len(calls)
        self._on_result = on_result
        try:
            while remaining:
                remaining -= self._step(handler, calls, timeout_s, results, pending, chunk)
        except BaseException:
            self.close()  # Ctrl-C, a load error or a stop from on_result mid-batch: workers hold half-done chunks
            raise
        finally:
            self._on_result = None
        return results

    def _finish(self, results: list, index: int, value) -> None:
        results[index] = value
        if self._on_result is not None:
            self._on_result(index, value)

    def _step(self, handler: Callable, calls: list, timeout_s: float, results: list, pending: deque,
              chunk: int) -> int:
        """Dispatch to idle workers, wait for answers, deaths or the next deadline; returns
        how many calls finished (answered or lost)."""
        for worker in self._workers:
            if worker.ready and not worker.calls and not worker.gone and pending:
                self._dispatch(worker, handler, calls, pending, chunk)
        now = time.monotonic()
        next_deadline = min((w.started + timeout_s for w in self._workers if w.calls), default=now + 1.0)
        # a worker's exit shows as EOF on its socket, so this also wakes on deaths
        wait([w.conn for w in self._workers if not w.gone], timeout=max(0.0, next_deadline - now))
        finished = 0
        for worker in list(self._workers):
            finished += self._drain(worker, results)
            if not worker.alive():
                finished += self._drain(worker, results)  # answers it sent just before dying
                if not worker.ready:
                    self._check_starting(worker)  # raises: a replacement could not load
                finished += self._replace(worker, WORKER_DIED, results, pending)
            elif worker.calls and time.monotonic() - worker.started > timeout_s:
                detail = f"no result within {timeout_s:g} s; the worker was killed and replaced"
                finished += self._replace(worker, TIMEOUT, results, pending, detail)
            else:
                self._check_starting(worker)
        return finished


def _exit_status(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            pass
    return f"exited with code {returncode}"
