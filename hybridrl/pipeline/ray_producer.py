"""Rollout workers as Ray actors (``pipeline.placement=disaggregated`` under
``launcher.name=ray``): each worker is an actor with its own engine, placed by Ray — on
another node of the cluster as readily as on this one. Weights travel through Ray's
object store (one ``ray.put`` of the policy per refit, shared by every worker), in the
same begin / load / finish bracket and verifier as every refit; every call has a timeout.

Inside the actor a :class:`~hybridrl.pipeline.producers.LocalProducer` drives the engine
on its own thread, so a refit or new requests reach it while it decodes (the actor runs
its methods on a few threads: ``max_concurrency``).
"""

from __future__ import annotations

import queue
from typing import Callable

import torch

from hybridrl.pipeline.producers import ProducerError, Sink
from hybridrl.pipeline.remote import OutOfProcessProducer, RefitPayload
from hybridrl.pipeline.work import Work
from hybridrl.pipeline.worker import WorkerSpec


class RolloutActor:
    """The actor body: an engine built like the run's, served by a LocalProducer."""

    def __init__(self, spec: WorkerSpec):
        from hybridrl.pipeline.producers import LocalProducer
        from hybridrl.pipeline.worker import build_worker_runner
        from hybridrl.trainer.rollout_worker import RolloutWorker
        from hybridrl.trainer.weight_sync import WeightSyncSpec

        torch.set_num_threads(spec.threads)
        engine, runner = build_worker_runner(spec)
        sync = WeightSyncSpec(bucket_bytes=spec.cfg.refit.bucket_mb << 20, verify=spec.verify)
        worker = RolloutWorker(engine, None, device=torch.device(spec.device), sync=sync)
        self._finished: queue.Queue = queue.Queue()
        self._producer = LocalProducer(0, worker, runner, lambda _, outs: self._finished.put(outs), lambda: None)

    def start(self, named: list, version: int) -> None:
        self._producer.start(named, version)

    def submit(self, work: list) -> None:
        self._producer.submit(work)

    def refit(self, named: list, version: int, partial: bool = False):
        return self._producer.refit(named, version, partial=partial)

    def poll(self, timeout_s: float) -> tuple[list, float, str | None]:
        """Finished samples (waits up to ``timeout_s`` for the first), idle seconds, failure."""
        out = []
        try:
            out.extend(self._finished.get(timeout=timeout_s))
            while True:
                out.extend(self._finished.get_nowait())
        except queue.Empty:
            pass
        return out, self._producer.idle_seconds, self._producer.failure

    def close(self) -> None:
        self._producer.close()


class RayProducer(OutOfProcessProducer):
    """The trainer's handle on one :class:`RolloutActor`; a collector thread polls it."""

    def __init__(self, index: int, spec: WorkerSpec, sink: Sink, wake: Callable[[], None], *, cpus: int = 1,
                 gpus: float = 0, payload: RefitPayload):
        """``payload``: what each refit sends (with LoRA: the adapters, the whole base only to
        an actor that does not hold it yet)."""
        import ray

        super().__init__(index, spec, sink, wake, payload)
        self.actor = ray.remote(RolloutActor).options(num_cpus=cpus, num_gpus=gpus, max_restarts=0,
                                                      max_concurrency=4, name=None).remote(spec)

    def _get(self, ref, what: str):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(ref, timeout=self.spec.timeout_s)
        except GetTimeoutError:
            raise ProducerError(f"rollout worker {self.index} (Ray actor) did not answer {what} within "
                                f"{self.spec.timeout_s:g} s (pipeline.timeout_s)") from None
        except (RayActorError, RayTaskError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ProducerError(f"rollout worker {self.index} (Ray actor) died {what} ({type(e).__name__}: "
                                f"{first[:200]})") from None

    def start(self, model: torch.nn.Module, version: int) -> None:
        named, _ = self.payload.next(model, fresh=True)
        self._get(self.actor.start.remote(_put(named), version), "while starting")
        self.payload.done()
        self.version = version
        self._start_collecting()

    def submit(self, work: list[Work]) -> None:
        self.actor.submit.remote(work)  # calls from one caller run in order

    def refit(self, model: torch.nn.Module, version: int):
        named, partial = self.payload.next(model)
        stats = self._get(self.actor.refit.remote(_put(named), version, partial), "on a refit")
        self.payload.done()
        self.version = version
        return stats

    def _poll(self) -> tuple[list, float, str | None]:
        return self._get(self.actor.poll.remote(0.5), "mid-step")

    def close(self) -> None:
        import ray

        self._closing = True
        if self._collector is not None:
            self._collector.join(timeout=5)
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def _put(named: list):
    """The refit's tensors as one object-store entry."""
    import ray

    return ray.put([(n, t.detach().cpu()) for n, t in named])
