"""The rollout side of the trainer: the engine, the run's sampling settings, refit, and
the check that the rollouts trained on were sampled by the policy being trained.

Weight versions: the engine advances ``weight_version`` once per complete weight update
(it is the only writer). This worker records the version its last refit produced; every
rollout carries the version that generated it, and :meth:`check_on_policy` fails loudly
when the two differ — a step would otherwise train on rollouts of other weights without
a word (on-policy today; an asynchronous trainer relaxes this to a staleness bound).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from hybridrl.refit import RefitStats, refit_from_model
from hybridrl.rollout import Rollouts, SamplingParams
from hybridrl.rollout.backend import RolloutBackend


RefitFn = Callable[..., RefitStats]  # (engine, model, *, bucket_bytes, verify) -> RefitStats


class StaleRolloutError(RuntimeError):
    """Rollouts generated with other weights than the policy being trained."""


class RolloutWorker:
    """``engine`` plus the run's sampling settings; tensors come back on ``device``."""

    def __init__(self, engine: RolloutBackend, sampling: SamplingParams, *, device: torch.device,
                 bucket_bytes: int, verify_refit: bool, refit_impl: RefitFn = refit_from_model):
        self.engine = engine
        self.sampling = sampling  # n, temperature, top-k/p, max_tokens, stop ids (seed set per prompt)
        self.device = device
        self.bucket_bytes, self.verify_refit = bucket_bytes, verify_refit
        self.refit_impl = refit_impl  # refit_from_model, or distributed.refit.refit_sharded under FSDP2
        self.expected_version: int | None = None  # the version the last refit produced
        # Versions are logical: engine version + offset. A resumed run continues the
        # numbering of the run it resumes (a fresh engine starts at 0).
        self.version_offset = 0

    @property
    def version(self) -> int:
        """The weight version the engine holds now (logical)."""
        return self.engine.weight_version + self.version_offset

    def refit(self, model: torch.nn.Module) -> RefitStats:
        """Write ``model``'s weights into the engine in place (the refit protocol)."""
        stats = self.refit_impl(self.engine, model, bucket_bytes=self.bucket_bytes, verify=self.verify_refit)
        self.expected_version = self.version
        return stats

    def release_memory(self) -> None:
        """Sampling is done until the next refit: an engine that can sleep (vLLM with
        ``rollout.free_cache_engine``) frees its KV cache and offloads its weights for the
        update; the refit wakes it. A no-op for the built-in engine."""
        sleep = getattr(self.engine, "sleep", None)
        if sleep is not None:
            sleep()

    def restore(self, model: torch.nn.Module, *, version: int) -> None:
        """After a resume: refit from the restored ``model`` and continue at ``version``."""
        self.refit(model)
        self.version_offset = version - self.engine.weight_version
        self.expected_version = self.version

    def sample(self, prompts: list[list[int]], seeds: list[int]) -> Rollouts:
        """``sampling.n`` responses per prompt, one seed per prompt (rows prompt-major)."""
        params = [dataclasses.replace(self.sampling, seed=s) for s in seeds]
        ro = self._to_device(self.engine.generate(prompts, params))
        ro.weight_version += self.version_offset
        return ro

    def greedy(self, prompts: list[list[int]]) -> Rollouts:
        """One greedy response per prompt (eval, ReMax baselines)."""
        params = SamplingParams(temperature=0.0, max_tokens=self.sampling.max_tokens,
                                stop_token_ids=self.sampling.stop_token_ids)
        return self.engine.generate(prompts, params)

    def check_on_policy(self, rollouts: Rollouts) -> None:
        """Raise unless ``rollouts`` were generated with the weights of the last refit."""
        if self.expected_version is None or rollouts.weight_version != self.expected_version:
            raise StaleRolloutError(
                f"rollouts were generated with engine weight_version {rollouts.weight_version}, but the policy "
                f"being trained was refit as version {self.expected_version}: the engine was updated outside "
                "RolloutWorker.refit or the step order changed; refit before sampling")

    def _to_device(self, ro: Rollouts) -> Rollouts:
        for name in ("input_ids", "attention_mask", "response_mask", "logprobs"):
            setattr(ro, name, getattr(ro, name).to(self.device))
        if ro.routed_experts is not None:
            ro.routed_experts = ro.routed_experts.to(self.device)
        return ro
