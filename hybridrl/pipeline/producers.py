"""Who generates: a *producer* turns admitted work (samples, agent episodes) into finished
samples on one engine, and takes new weights when the batch source publishes them.

Every producer has the same interface (:class:`Producer`):

- :class:`InlineProducer`: the trainer's own engine, stepped by the trainer's thread
  while it waits for a batch (``trainer.mode=sync``: the source at staleness 0). With a
  tensor-parallel engine every rank of the generation group adds every rank's work in
  rank order and steps its shard in lockstep.
- :class:`LocalProducer` (``pipeline.placement=colocated``): a thread in the trainer
  process driving an engine of its own.
- ``RemoteProducer`` (``remote.py``, ``disaggregated``): a worker process with its own
  engine, refit through shared memory; ``RayProducer`` (``ray_producer.py``): a Ray actor,
  refit through the object store.

Producers hand finished samples to ``sink(index, finished)`` and call ``wake()`` when they
fail (``failure`` then holds one line saying why). ``refit`` blocks until the producer
holds the new weights; in-flight requests pause for it and go on with them (partial
rollouts: every token carries the version that sampled it).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Protocol

import torch

from hybridrl.pipeline.work import Work, WorkRunner, finished_key
from hybridrl.refit import RefitStats, refit_from_model
from hybridrl.rollout.requests import RequestOutput

Sink = Callable[[int, list], None]


class ProducerError(RuntimeError):
    """A rollout worker failed (died, raised, or stopped answering)."""


class Producer(Protocol):
    index: int
    version: int | None  # the weight version the producer's engine holds
    failure: str | None  # one line, once it failed
    idle_seconds: float  # cumulative time with nothing to run

    def start(self, model, version: int) -> None:
        """Load ``model`` as ``version`` and start serving."""

    def submit(self, work: list[Work]) -> None: ...

    def refit(self, model, version: int) -> RefitStats | None: ...

    def close(self) -> None: ...


class InlineProducer:
    """The trainer's engine (``RolloutWorker``), run by the caller of :meth:`run_until`."""

    inline = True

    def __init__(self, index: int, worker, runner: WorkRunner, sink: Sink):
        self.index, self.worker, self.runner, self._sink = index, worker, runner, sink
        self.version: int | None = None
        self.failure: str | None = None
        self.idle_seconds = 0.0
        self._pending: list[Work] = []
        self._own: set[str] = set()  # keys of this rank's work (a TP group runs every rank's)

    def start(self, model, version: int) -> None:
        if self.worker.version != version:
            self.worker.push(model, version)
        self.version = version

    def submit(self, work: list[Work]) -> None:
        self._pending.extend(work)

    def refit(self, model, version: int) -> RefitStats:
        stats = self.worker.push(model, version)
        self.version = version
        return stats

    def run_until(self, ready: Callable[[], bool]) -> None:
        """Step the engine until ``ready()`` holds and nothing is left to run — on every rank
        of a tensor-parallel group (they decide together: one engine step is collective)."""
        mesh = self.worker.mesh
        while True:
            settled = not self._pending and not self.runner.busy() and ready()
            if mesh is not None:
                votes: list = [None] * mesh.tp.size
                torch.distributed.all_gather_object(votes, settled, group=mesh.tp.group)
                settled = all(votes)
            if settled:
                return
            if not self._pump():
                time.sleep(0.002)  # waiting for rewards only

    def _pump(self) -> bool:
        """Admit pending work and run one engine step; whether anything ran."""
        work, self._pending = self._pending, []
        mesh = self.worker.mesh
        if mesh is not None:  # every group rank adds every rank's work, in rank order, under rank-unique keys
            work = [dataclasses.replace(w, key=f"{mesh.tp.rank}@{w.key}") for w in work]
        self._own.update(w.key for w in work)
        if mesh is not None:
            work, _ = mesh.gather(work)
        if work:
            self.runner.submit(work)
        if not self.runner.busy():
            return False
        finished = [f for f in self.runner.pump() if finished_key(f) in self._own]
        self._own.difference_update(finished_key(f) for f in finished)
        if finished:
            self._sink(self.index, finished if mesh is None else [_unprefixed(f) for f in finished])
        return True

    def release_memory(self) -> None:
        self.worker.release_memory()

    def close(self) -> None:
        self.runner.abort()
        self.runner.close()


def _unprefixed(item):
    """A finished sample or episode under its source's key (a TP group's ``rank@key``)."""
    field = "request_id" if isinstance(item, RequestOutput) else "episode_id"
    return dataclasses.replace(item, **{field: finished_key(item).split("@", 1)[1]})


class LocalProducer:
    """A generation thread on its own engine (``worker``: a ``RolloutWorker``)."""

    def __init__(self, index: int, worker, runner: WorkRunner, sink: Sink, wake: Callable[[], None]):
        self.index, self.worker, self.runner, self._sink, self._wake = index, worker, runner, sink, wake
        self.version: int | None = None
        self.failure: str | None = None
        self.idle_seconds = 0.0
        self._engine_lock = threading.Lock()  # one engine step or one refit at a time
        self._cond = threading.Condition()
        self._pending: list[Work] = []
        self._stop = False
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name=f"rollout-{index}", daemon=True)

    def start(self, model, version: int) -> None:
        self.refit(model, version)
        self._thread.start()

    def submit(self, work: list[Work]) -> None:
        with self._cond:
            self._pending.extend(work)
            self._cond.notify()

    def refit(self, model, version: int, *, partial: bool = False) -> RefitStats:
        """``partial``: ``model`` is a list of named tensors covering some of the engine's
        (a LoRA payload computed by the trainer: a Ray rollout actor's)."""
        with self._engine_lock:
            if partial:
                w = self.worker.weights.spec
                stats = refit_from_model(self.worker.engine, model, bucket_bytes=w.bucket_bytes, verify=w.verify,
                                         partial=True, version=version)
            else:
                stats = self.worker.push(model, version)
        self.version = version
        return stats

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        self.runner.close()

    def _run(self) -> None:
        # OpenMP thread counts are per thread: a new thread would use every core and reduce
        # in another order than the trainer's setting (trainer.threads)
        torch.set_num_threads(self._threads)
        try:
            while True:
                with self._cond:
                    t0 = time.perf_counter()
                    while not (self._stop or self._pending or self.runner.busy()):
                        self._cond.wait()
                    self.idle_seconds += time.perf_counter() - t0
                    if self._stop:
                        return
                    pending, self._pending = self._pending, []
                with self._engine_lock:
                    self.runner.submit(pending)
                    finished = self.runner.pump() if self.runner.busy() else []
                if finished:
                    self._sink(self.index, finished)
        except BaseException as e:  # noqa: BLE001 - reported to the trainer, which decides
            self.failure = f"rollout worker {self.index} (thread) failed: {type(e).__name__}: {e}".splitlines()[0]
            self._wake()
