"""The trainer's own engine: the run's sampling settings, the weight path into it, and the
one-call helpers that eval and baselines use (``greedy``, ``sample``).

Weight versions: the batch source (``pipeline/source.py``) decides the version every
publication of the policy gets and hands it to :meth:`RolloutWorker.push`; the engine
records it (its only writer is the refit it receives). This worker keeps no count of its own.
The path the weights take (whole, FSDP gather, tensor-parallel shards, LoRA adapters, or
nothing for an engine sharing the trainer's modules) is chosen once, at construction
(``weight_sync.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from hybridrl.config import RefitConfig, RolloutConfig
from hybridrl.refit import RefitStats
from hybridrl.rollout import Rollouts, SamplingParams
from hybridrl.rollout.backend import RolloutBackend
from hybridrl.rollout.rollouts import rollouts_to_device
from hybridrl.trainer.weight_sync import WeightSyncSpec, weight_sync_for


class RolloutWorker:
    """``engine`` plus the run's sampling settings; tensors come back on ``device``."""

    def __init__(self, engine: RolloutBackend, sampling: SamplingParams, *, device: torch.device,
                 sync: WeightSyncSpec, mesh=None):
        """``sync``: how weights reach ``engine`` (``weight_sync.py``). ``mesh``: this rank's
        generation group (``distributed/mesh.py``) when the engine is one tensor-parallel
        shard; the group's ranks then step it together (``pipeline/inline.py``)."""
        self.engine = engine
        self.sampling = sampling  # n, temperature, top-k/p, max_tokens, stop ids (seed set per prompt)
        self.device = device
        self.mesh = mesh if mesh is not None and mesh.tp.size > 1 else None
        self.lora = sync.lora
        self.weights = weight_sync_for(engine, sync)

    @classmethod
    def from_config(cls, engine: RolloutBackend, rollout: RolloutConfig, refit: RefitConfig, *,
                    stop: tuple[int | None, tuple[int, ...]], device: torch.device, sharded: bool = False,
                    mesh=None, lora=None) -> RolloutWorker:
        """The run's worker: ``rollout.*`` sampling, stopping at ``stop = (eos_token_id,
        vision_ids)`` (a VL policy's vision tokens end a sample, see ``data/vision.py``; () for
        text), and ``refit.*``; ``sharded``: the policy is FSDP2-sharded for RL (several ranks)."""
        spec = WeightSyncSpec(bucket_bytes=refit.bucket_mb << 20, verify=refit.verify, sharded=sharded,
                              tensor_parallel=mesh is not None and mesh.tp.size > 1, lora=lora,
                              lora_mode=rollout.lora_mode)
        return cls(engine, sampling_params(rollout, *stop), device=device, sync=spec, mesh=mesh)

    @property
    def version(self) -> int:
        """The weight version the engine holds now (0: none yet)."""
        return self.engine.weight_version

    def push(self, model: torch.nn.Module, version: int) -> RefitStats:
        """Write ``model``'s weights into the engine in place, numbered ``version``."""
        return self.weights.push(model, version)

    def release_memory(self) -> None:
        """Sampling is done until the next refit: an engine that can sleep (vLLM with
        ``rollout.free_cache_engine``) frees its KV cache and offloads its weights for the
        update; the refit wakes it. A no-op for the built-in engine."""
        sleep = getattr(self.engine, "sleep", None)
        if sleep is not None:
            sleep()

    def sample(self, prompts: list[list[int]], seeds: list[int]) -> Rollouts:
        """``sampling.n`` responses per prompt, one seed per prompt (rows prompt-major), in one call."""
        params = [dataclasses.replace(self.sampling, seed=s) for s in seeds]
        return rollouts_to_device(self.engine.generate(prompts, params), self.device)

    def greedy(self, prompts: list[list[int]], images: list | None = None) -> Rollouts:
        """One greedy response per prompt (eval, ReMax baselines); ``images``: per prompt (VL)."""
        params = SamplingParams(temperature=0.0, max_tokens=self.sampling.max_tokens,
                                stop_token_ids=self.sampling.stop_token_ids)
        if images and any(i is not None for i in images):
            return self.engine.generate(prompts, params, images=images)
        return self.engine.generate(prompts, params)


def sampling_params(rollout: RolloutConfig, eos_token_id: int | None,
                    vision_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The one translation of ``rollout.*`` into engine sampling settings (training and
    ``hybridrl eval`` alike); the per-prompt seed is set at sampling time. Stops at
    ``eos_token_id`` and at a VL policy's ``vision_ids`` (``pipeline/engines.py::vision_ids``)."""
    stops = ((eos_token_id,) if eos_token_id is not None else ()) + tuple(vision_ids)
    return SamplingParams(temperature=rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p,
                          max_tokens=rollout.max_tokens, n=rollout.n, stop_token_ids=stops)
