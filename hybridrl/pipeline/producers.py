"""Who generates in an overlapped run: a producer turns admitted requests into finished
samples, one engine each, and takes new weights when the trainer publishes them.

- :class:`LocalProducer` (``pipeline.placement=colocated``): a thread in the trainer
  process driving an in-process engine; trainer and generation time-share the device.
- :class:`RemoteProducer` (``disaggregated``): a worker process (``worker.py``) with its
  own engine, refit through shared memory.

Both hand finished samples to ``sink(index, outputs)`` from their own thread and call
``wake()`` when they fail (``failure`` then holds one line saying why). ``refit`` blocks
until the producer holds the new weights; its in-flight requests pause for it and go on
with the new weights (partial rollouts: every token carries the version that sampled it).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from hybridrl.pipeline.worker import WorkerSpec, worker_main
from hybridrl.refit.errors import RefitError
from hybridrl.rollout.backend import pad_step

Sink = Callable[[int, list], None]
Request = tuple  # (request_id, prompt token ids, SamplingParams with n=1)


class ProducerError(RuntimeError):
    """A rollout worker failed (died, raised, or stopped answering)."""


class RefitPayload:
    """What one producer's next refit sends: the policy's tensors, or with LoRA
    (``lora``: the trainer's ``LoRAPolicy``) its adapters / merged targets, plus the whole
    base to an engine that does not hold the current one (a new or restarted worker)."""

    def __init__(self, lora, cfg):
        self.lora, self.mode, self.dtype = lora, cfg.rollout.lora_mode, cfg.model.torch_dtype
        self._held: int | None = None  # the base version the producer's engine holds
        self._sending: int | None = None

    def next(self, model: torch.nn.Module, *, fresh: bool = False) -> tuple[list, bool]:
        """(named tensors, partial); ``fresh``: the engine holds nothing yet."""
        from hybridrl.refit.transport import named_trainer_tensors

        if self.lora is None:
            return list(named_trainer_tensors(model)), False
        named, partial = self.lora.refit_payload(self.mode, None if fresh else self._held, dtype=self.dtype)
        self._sending = self.lora.base_version
        return named, partial

    def done(self) -> None:
        """The refit of the last :meth:`next` succeeded."""
        self._held = self._sending


class LocalProducer:
    """A generation thread on ``worker.engine`` (a ``RolloutWorker`` of its own)."""

    def __init__(self, index: int, worker, sink: Sink, wake: Callable[[], None], *, step_latency_s: float = 0.0):
        self.index, self.worker, self._sink, self._wake = index, worker, sink, wake
        self.step_latency_s = step_latency_s
        self.version: int | None = None
        self.failure: str | None = None
        self.idle_seconds = 0.0
        self._engine_lock = threading.Lock()  # one engine step or one refit at a time
        self._cond = threading.Condition()
        self._pending: list[Request] = []
        self._stop = False
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name=f"rollout-{index}", daemon=True)

    def start(self, model: torch.nn.Module, version: int) -> None:
        self.worker.catch_up(model, version)
        self.version = version
        self._thread.start()

    def submit(self, requests: list[Request]) -> None:
        with self._cond:
            self._pending.extend(requests)
            self._cond.notify()

    def refit(self, model: torch.nn.Module, version: int, *, partial: bool = False) -> None:
        with self._engine_lock:
            self.worker.refit(model, partial=partial)
        self.version = version

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def _run(self) -> None:
        # OpenMP thread counts are per thread: a new thread would use every core and reduce
        # in another order than the trainer's setting (trainer.threads)
        torch.set_num_threads(self._threads)
        engine = self.worker.engine
        try:
            while True:
                with self._cond:
                    t0 = time.perf_counter()
                    while not (self._stop or self._pending or engine.has_unfinished_requests()):
                        self._cond.wait()
                    self.idle_seconds += time.perf_counter() - t0
                    if self._stop:
                        return
                    pending, self._pending = self._pending, []
                t0 = time.perf_counter()
                with self._engine_lock:
                    for rid, prompt, params in pending:
                        engine.add_request(rid, prompt, params)
                    out = engine.step() if engine.has_unfinished_requests() else None
                pad_step(t0, self.step_latency_s)
                if out is not None and out.finished:
                    self._sink(self.index, out.finished)
        except BaseException as e:  # noqa: BLE001 - reported to the trainer, which decides
            self.failure = f"rollout worker {self.index} (thread) failed: {type(e).__name__}: {e}".splitlines()[0]
            self._wake()


class RemoteProducer:
    """A worker process (``worker.worker_main``) and the trainer's ends of its pipe and
    refit channel; a collector thread reads its results."""

    def __init__(self, index: int, spec: WorkerSpec, sink: Sink, wake: Callable[[], None], *,
                 bucket_bytes: int, lora=None):
        """``lora``: the trainer's ``LoRAPolicy``: refits send its payload (``RefitPayload``)."""
        import torch.multiprocessing as mp

        from hybridrl.refit.shm import make_channel

        self.index, self.spec, self._sink, self._wake = index, spec, sink, wake
        self.payload = RefitPayload(lora, spec.cfg)
        self.version: int | None = None
        self.failure: str | None = None
        self.idle_seconds = 0.0
        self._closing = False
        ctx = mp.get_context("spawn")
        engine_side, self._channel = make_channel(bucket_bytes, ctx=ctx)
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(spec, child, engine_side), name=f"rollout-{index}",
                                   daemon=True)
        self.process.start()
        child.close()  # only the worker holds its ends: its death reads as end-of-file here
        engine_side.conn.close()
        self._collector: threading.Thread | None = None

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
        self.version = version
        self._collector = threading.Thread(target=self._collect, name=f"rollout-{self.index}-results", daemon=True)
        self._collector.start()

    def submit(self, requests: list[Request]) -> None:
        self._send(("add", requests))

    def refit(self, model: torch.nn.Module, version: int) -> None:
        self._refit(model, None)
        self.version = version

    def _refit(self, model: torch.nn.Module, align: int | None, *, fresh: bool = False) -> None:
        from hybridrl.refit.shm import send_refit

        named, partial = self.payload.next(model, fresh=fresh)
        self._send(("refit", align))
        try:
            send_refit(self._channel, named, timeout_s=self.spec.timeout_s, partial=partial)
        except RefitError as e:
            raise ProducerError(f"rollout worker {self.index} (pid {self.pid}): refit failed: {e}") from None
        self.payload.done()

    def _send(self, msg) -> None:
        try:
            self._conn.send(msg)
        except (OSError, ValueError):
            raise ProducerError(self._death(f"on {msg[0]!r}")) from None

    def _death(self, when: str) -> str:
        self.process.join(timeout=5)
        return (f"rollout worker {self.index} (pid {self.pid}) died {when} "
                f"(exit code {self.process.exitcode})")

    def _collect(self) -> None:
        while True:
            try:
                if not self._conn.poll(0.5):
                    if self.process.is_alive() or self._closing:
                        if self._closing:
                            return
                        continue
                    raise EOFError
                msg = self._conn.recv()
            except (EOFError, OSError):
                if not self._closing:
                    self.failure = self._death("mid-step")
                    self._wake()
                return
            if msg[0] == "finished":
                self.idle_seconds = msg[2]
                self._sink(self.index, msg[1])
            elif msg[0] == "error":
                self.failure = f"rollout worker {self.index} (pid {self.pid}) failed: {msg[1]}"
                self._wake()
                return

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
