"""Producers in other processes: what their refits send (:class:`RefitPayload`) and the
worker-process producer (:class:`RemoteProducer`, ``pipeline.placement=disaggregated``),
whose worker (``worker.py``) runs its own engine and is refit through shared memory.
``ray_producer.py`` is the same over Ray's object store.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from hybridrl.pipeline.producers import ProducerError, Sink
from hybridrl.pipeline.work import Work
from hybridrl.pipeline.worker import WorkerSpec, worker_main
from hybridrl.refit import RefitStats
from hybridrl.refit.errors import RefitError


class RefitPayload:
    """What one producer's next refit sends: the policy's tensors (``weights()``: whole
    tensors, gathered once per publication when the policy is sharded), or with LoRA
    (``lora``: the trainer's ``LoRAPolicy``) its adapters / merged targets, plus the whole
    base to an engine that does not hold the current one (a new or restarted worker)."""

    def __init__(self, lora, cfg, weights: Callable[[torch.nn.Module], list]):
        self.lora, self.mode, self.dtype = lora, cfg.rollout.lora_mode, cfg.model.torch_dtype
        self.weights = weights
        self._held: int | None = None  # the base version the producer's engine holds
        self._sending: int | None = None

    def next(self, model: torch.nn.Module, *, fresh: bool = False) -> tuple[list, bool]:
        """(named tensors, partial); ``fresh``: the engine holds nothing yet."""
        if self.lora is None:
            return self.weights(model), False
        named, partial = self.lora.refit_payload(self.mode, None if fresh else self._held, dtype=self.dtype)
        self._sending = self.lora.base_version
        return named, partial

    def done(self) -> None:
        """The refit of the last :meth:`next` succeeded."""
        self._held = self._sending


class OutOfProcessProducer:
    """The trainer's side of a producer in another process (a worker process, a Ray actor):
    the bookkeeping every producer keeps (``Producer`` in producers.py) and a collector thread
    that polls the worker (``_poll``) and hands its finished work to the source."""

    def __init__(self, index: int, spec: WorkerSpec, sink: Sink, wake: Callable[[], None], payload: RefitPayload):
        self.index, self.spec, self._sink, self._wake = index, spec, sink, wake
        self.payload = payload
        self.version: int | None = None
        self.failure: str | None = None
        self.idle_seconds = 0.0
        self._closing = False
        self._collector: threading.Thread | None = None

    def _poll(self) -> tuple[list, float, str | None] | None:
        """(finished work, idle seconds, failure line) or None (nothing within a short wait);
        raises ``ProducerError`` when the worker is gone."""
        raise NotImplementedError

    def _start_collecting(self) -> None:
        self._collector = threading.Thread(target=self._collect, name=f"rollout-{self.index}-results", daemon=True)
        self._collector.start()

    def _collect(self) -> None:
        while not self._closing:
            try:
                got = self._poll()
            except ProducerError as e:
                self._fail(str(e))
                return
            if got is None:
                continue
            finished, idle, failure = got
            self.idle_seconds = idle
            if finished:
                self._sink(self.index, finished)
            if failure:
                self._fail(failure)
                return

    def _fail(self, line: str) -> None:
        if not self._closing:
            self.failure = line
            self._wake()


class RemoteProducer(OutOfProcessProducer):
    """A worker process (``worker.worker_main``) and the trainer's ends of its pipe and
    refit channel."""

    def __init__(self, index: int, spec: WorkerSpec, sink: Sink, wake: Callable[[], None], *, bucket_bytes: int,
                 payload: RefitPayload):
        import torch.multiprocessing as mp

        from hybridrl.refit.shm import make_channel

        super().__init__(index, spec, sink, wake, payload)
        ctx = mp.get_context("spawn")
        engine_side, self._channel = make_channel(bucket_bytes, ctx=ctx)
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(spec, child, engine_side), name=f"rollout-{index}",
                                   daemon=True)
        self.process.start()
        child.close()  # only the worker holds its ends: its death reads as end-of-file here
        engine_side.conn.close()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def start(self, model: torch.nn.Module, version: int) -> None:
        """Wait for the worker's engine, load ``model`` into it as ``version``, start collecting."""
        t = self.spec.timeout_s
        if not self._conn.poll(t):
            self.close()
            raise ProducerError(f"rollout worker {self.index} (pid {self.pid}) did not start within {t:g} s "
                                "(pipeline.timeout_s); see its output above")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            raise ProducerError(self._death("while starting")) from None
        if kind == "error":
            raise ProducerError(f"rollout worker {self.index} failed to start: {payload}")
        self._refit(model, version, fresh=True)
        self._start_collecting()

    def submit(self, work: list[Work]) -> None:
        self._send(("add", work))

    def refit(self, model: torch.nn.Module, version: int) -> RefitStats:
        return self._refit(model, version)

    def _refit(self, model: torch.nn.Module, version: int, *, fresh: bool = False) -> RefitStats:
        from hybridrl.refit.shm import send_refit

        named, partial = self.payload.next(model, fresh=fresh)
        self._send(("refit",))
        try:
            stats = send_refit(self._channel, named, timeout_s=self.spec.timeout_s, partial=partial, version=version)
        except RefitError as e:
            raise ProducerError(f"rollout worker {self.index} (pid {self.pid}): refit failed: {e}") from None
        self.payload.done()
        self.version = version
        return stats

    def _send(self, msg) -> None:
        try:
            self._conn.send(msg)
        except (OSError, ValueError):
            raise ProducerError(self._death(f"on {msg[0]!r}")) from None

    def _death(self, when: str) -> str:
        self.process.join(timeout=5)
        return (f"rollout worker {self.index} (pid {self.pid}) died {when} "
                f"(exit code {self.process.exitcode})")

    def _poll(self) -> tuple[list, float, str | None] | None:
        try:
            if not self._conn.poll(0.5):
                if self._closing or self.process.is_alive():
                    return None
                raise EOFError
            msg = self._conn.recv()
        except (EOFError, OSError):
            raise ProducerError(self._death("mid-step")) from None
        if msg[0] == "finished":
            return msg[1], msg[2], None
        if msg[0] == "error":
            return [], self.idle_seconds, f"rollout worker {self.index} (pid {self.pid}) failed: {msg[1]}"
        return None

    def close(self) -> None:
        self._closing = True
        try:
            self._conn.send(("stop",))
        except (OSError, ValueError):
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        if self._collector is not None:
            self._collector.join(timeout=5)
        self._conn.close()
        self._channel.conn.close()
