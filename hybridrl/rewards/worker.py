"""What runs inside a reward worker process, and how the function gets there.

The pool (``process_pool.py``) starts ``python -c <boot>`` which calls
:func:`worker_boot`. The function arrives pickled by :func:`dumps_for_worker`: by
reference for importable functions, and as its ``path/to/file.py:fn`` spec for functions
loaded from files (not importable by name), which the worker loads again.

Protocol on the worker's socket: the parent sends ``(sys.path, payload)``, then chunks
``(handler, calls)`` (or None to stop); the worker answers ``("ready", None)`` or
``("error", "one line")`` once, then ``("result", handler(fn, *args))`` per call.
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable

_PR_SET_PDEATHSIG = 1


class _SpecPickler(pickle.Pickler):
    """Pickles a function loaded from a file (it carries ``hybridrl_spec``) as that spec,
    to be loaded again in the worker; refuses functions of ``__main__``, which the worker
    does not import; everything else pickles as usual."""

    def reducer_override(self, obj: Any):
        if not callable(obj):
            return NotImplemented
        spec = getattr(obj, "hybridrl_spec", None)
        if isinstance(spec, str):
            return _load_spec, (spec,)
        if getattr(obj, "__module__", None) == "__main__":
            raise pickle.PicklingError(f"{getattr(obj, '__qualname__', obj)!r} is defined in the script being run")
        return NotImplemented


def _load_spec(spec: str) -> Callable:
    from hybridrl.rewards.registry import get_reward_fn

    return get_reward_fn(spec)


def dumps_for_worker(fn: Callable) -> bytes:
    """``fn`` pickled for a worker; raises (PicklingError, AttributeError...) for lambdas,
    local functions and functions of ``__main__``, which a fresh process cannot import."""
    buf = io.BytesIO()
    _SpecPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(fn)
    return buf.getvalue()


def _die_with_parent(parent_pid: int) -> None:
    # Linux: the kernel SIGKILLs this worker when the trainer (strictly: the trainer thread
    # that started it) dies, even mid-call with the GIL held, so no orphans are left.
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            return
    if os.getppid() != parent_pid:  # it died before the request took effect
        os._exit(0)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def limit_memory(megabytes: int) -> None:
    """Cap this process's data memory: past it, allocations fail (MemoryError in Python,
    which fails the sample as "memory limit"; the worker lives on).

    RLIMIT_DATA rather than RLIMIT_AS: since Linux 4.7 it counts the heap and every private
    writable mapping (numpy buffers, Python's arenas), but not shared libraries or the
    address space glibc and thread pools reserve without using, which under RLIMIT_AS would
    eat hundreds of MB of the budget after ``import torch``."""
    import resource

    limit = megabytes << 20
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def worker_boot(fd: int, parent_pid: int, memory_limit_mb: int = 0) -> None:
    """Worker entry: receive ``(sys.path, payload)``, load the function, say ready, then run
    chunks ``(handler, calls)`` answering ``("result", handler(fn, *args))`` call by call."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    _die_with_parent(parent_pid)
    conn = Connection(fd)
    try:
        if memory_limit_mb:
            limit_memory(memory_limit_mb)
        sys.path[:], payload = conn.recv()
        fn = pickle.loads(payload)
        warmup = getattr(fn, "hybridrl_warmup", None)
        if warmup is not None:
            warmup()
    except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
        hint = f" (with reward.memory_limit_mb={memory_limit_mb}; raise it)" if isinstance(e, MemoryError) else ""
        conn.send(("error", _one_line(e) + hint))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if message is None:
            return
        handler, calls = message
        for args in calls:
            conn.send(("result", handler(fn, *args)))
