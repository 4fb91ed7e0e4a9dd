"""The rollout side of the trainer: the engine, the run's sampling settings, refit, and
the check that the rollouts trained on were sampled by the policy being trained.

Weight versions: the engine advances ``weight_version`` once per complete weight update
(it is the only writer; a resumed run continues its numbering through the engine's own
``load_state_dict``). This worker records the version its last refit produced; every
rollout carries the version that generated it, and :meth:`check_on_policy` fails loudly
when the two differ — a step would otherwise train on rollouts of other weights without
a word (on-policy today; an asynchronous trainer relaxes this to a staleness bound).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

import torch

from hybridrl.refit import RefitStats, refit_from_model
from hybridrl.rollout import Rollouts, SamplingParams
from hybridrl.config import RefitConfig, RolloutConfig
from hybridrl.rollout.backend import RolloutBackend, pad_step, request_seed
from hybridrl.rollout.requests import RequestOutput
from hybridrl.rollout.rollouts import rollouts_from_outputs, rollouts_to_device


class StaleRolloutError(RuntimeError):
    """Rollouts generated with other weights than the policy being trained."""


class RolloutWorker:
    """``engine`` plus the run's sampling settings; tensors come back on ``device``."""

    def __init__(self, engine: RolloutBackend, sampling: SamplingParams, *, device: torch.device,
                 bucket_bytes: int, verify_refit: bool, step_latency_s: float = 0.0, mesh=None,
                 lora=None, lora_mode: str = "adapter"):
        """``mesh``: this rank's generation group (``distributed/mesh.py``) when the engine is
        one tensor-parallel shard; the group's ranks then generate their prompts together.
        ``lora``: the policy's :class:`~hybridrl.lora.LoRAPolicy` when it trains adapters; a
        refit then sends the adapters (``lora_mode="adapter"``) or the merged targeted
        weights (``"merged"``), and the whole base only to an engine that never held it."""
        self.engine = engine
        self.lora, self.lora_mode = lora, lora_mode
        self._engine_base_version: int | None = None  # LoRA: the base version the engine holds
        self.mesh = mesh if mesh is not None and mesh.tp.size > 1 else None
        self.step_latency_s = step_latency_s  # rollout.step_latency_ms: a training-rollout step lasts at least this
        self.sampling = sampling  # n, temperature, top-k/p, max_tokens, stop ids (seed set per prompt)
        self.device = device
        self.bucket_bytes, self.verify_refit = bucket_bytes, verify_refit
        self.expected_version: int | None = None  # the version the last refit produced
        self._calls = itertools.count()  # request ids unique across sample_groups calls

    @classmethod
    def from_config(cls, engine: RolloutBackend, rollout: RolloutConfig, refit: RefitConfig, *,
                    eos_token_id: int | None, device: torch.device, mesh=None, lora=None) -> RolloutWorker:
        """The run's worker: ``rollout.*`` sampling (stopping at ``eos_token_id``) and ``refit.*``."""
        return cls(engine, sampling_params(rollout, eos_token_id), device=device, bucket_bytes=refit.bucket_mb << 20,
                   verify_refit=refit.verify, step_latency_s=rollout.step_latency_ms / 1000, mesh=mesh,
                   lora=lora, lora_mode=rollout.lora_mode)

    @property
    def version(self) -> int:
        """The weight version the engine holds now."""
        return self.engine.weight_version

    def refit(self, model: torch.nn.Module, *, partial: bool = False) -> RefitStats:
        """Write ``model``'s weights into the engine in place (the refit protocol); an
        FSDP2-sharded model is gathered bucket by bucket (``distributed/refit.py``), or, into a
        built-in tensor-parallel shard, exchanged shard to shard (``distributed/tp_refit.py``).
        LoRA: the base is frozen, so after the engine's first load a refit is *partial* —
        the adapters or the merged targets only (a few MB), verified like a full one. An
        engine that runs the trainer's own modules (``rollout.exact``) is sent nothing: it
        advances its version, as a refit of identical weights would. ``partial``: ``model``
        is a list of named tensors that covers only some of the engine's (a LoRA payload
        computed elsewhere: a Ray rollout actor's)."""
        if getattr(self.engine, "shares_trainer_weights", False):
            self.expected_version = self.engine.advance_version()
            return RefitStats(bytes_moved=0, seconds=0.0, version=self.expected_version, num_tensors=0)
        if self.lora is not None:
            held = None if self.engine.weight_version == 0 else self._engine_base_version
            named, partial = self.lora.refit_payload(self.lora_mode, held,  # whole tensors (FSDP2: gathered)
                                                     dtype=getattr(self.engine, "dtype", None))
            stats = refit_from_model(self.engine, named, bucket_bytes=self.bucket_bytes, verify=self.verify_refit,
                                     partial=partial)
            self._engine_base_version = self.lora.base_version
            self.expected_version = self.version
            return stats
        if partial:
            stats = refit_from_model(self.engine, model, bucket_bytes=self.bucket_bytes, verify=self.verify_refit,
                                     partial=True)
            self.expected_version = self.version
            return stats
        refit = refit_from_model  # a whole model: the engine takes its tensor-parallel slices itself
        if _is_fsdp_sharded(model) and self.mesh is not None and getattr(self.engine, "takes_tp_slices", False):
            from hybridrl.distributed.tp_refit import refit_sharded_tp as refit  # FSDP shards -> TP shards
        elif _is_fsdp_sharded(model):
            from hybridrl.distributed.refit import refit_sharded as refit
        stats = refit(self.engine, model, bucket_bytes=self.bucket_bytes, verify=self.verify_refit)
        self.expected_version = self.version
        return stats

    def catch_up(self, model: torch.nn.Module, version: int) -> RefitStats:
        """Refit from ``model`` and number the result ``version`` (an engine that joins a run
        late: a rollout worker of an overlapped run, or the eval engine refit on demand)."""
        stats = self.refit(model)
        self.engine.load_state_dict({"weight_version": version})
        self.expected_version = self.version
        return stats

    def release_memory(self) -> None:
        """Sampling is done until the next refit: an engine that can sleep (vLLM with
        ``rollout.free_cache_engine``) frees its KV cache and offloads its weights for the
        update; the refit wakes it. A no-op for the built-in engine."""
        sleep = getattr(self.engine, "sleep", None)
        if sleep is not None:
            sleep()

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def restore(self, model: torch.nn.Module, state: dict) -> None:
        """After a resume: refit from the restored ``model``, then continue the version
        numbering saved in ``state`` (``state_dict()``)."""
        self.refit(model)
        self.engine.load_state_dict(state)
        self.expected_version = self.version

    def sample(self, prompts: list[list[int]], seeds: list[int]) -> Rollouts:
        """``sampling.n`` responses per prompt, one seed per prompt (rows prompt-major)."""
        if self.mesh is not None:  # the group generates every rank's prompts together
            return self.sample_groups(prompts, seeds, lambda g, outputs: None)
        params = [dataclasses.replace(self.sampling, seed=s) for s in seeds]
        return self._to_device(self.engine.generate(prompts, params))

    def sample_groups(self, prompts: list[list[int]], seeds: list[int],
                      on_group: Callable[[int, list[RequestOutput]], None]) -> Rollouts:
        """:meth:`sample` through the engine's request API: ``on_group(g, outputs)`` is called
        as soon as all ``n`` samples of prompt ``g`` finished (while later groups still
        decode), so their scoring overlaps the rest of the generation. Same seeds, same
        tokens as :meth:`sample` (sample j of a prompt seeded ``request_seed(seed, j)``)."""
        n, call = self.sampling.n, next(self._calls)
        own = range(len(prompts))
        if self.mesh is not None:  # every group rank adds every rank's requests, in rank order
            pairs, offset = self.mesh.gather(list(zip(prompts, seeds)))
            prompts, seeds = [p for p, _ in pairs], [s for _, s in pairs]
            own, report = range(offset, offset + len(own)), on_group
            on_group = lambda g, outputs: report(g - offset, outputs) if g in own else None  # noqa: E731
        ids = [[f"rollout-{call}-{g}-{j}" for j in range(n)] for g in range(len(prompts))]
        for g, (prompt, seed) in enumerate(zip(prompts, seeds)):
            for j in range(n):
                params = dataclasses.replace(self.sampling, n=1, seed=request_seed(seed, j))
                self.engine.add_request(ids[g][j], prompt, params)
        group_of = {rid: g for g, row in enumerate(ids) for rid in row}
        done: dict[str, RequestOutput] = {}
        left = [n] * len(prompts)
        try:
            while len(done) < len(group_of):
                t0 = time.perf_counter()
                finished = self.engine.step().finished
                pad_step(t0, self.step_latency_s)
                for out in finished:
                    g = group_of.get(out.request_id)
                    if g is None:
                        continue  # someone else's request sharing the engine
                    done[out.request_id] = out
                    left[g] -= 1
                    if left[g] == 0:
                        on_group(g, [done[rid] for rid in ids[g]])
        except BaseException:
            for rid in group_of.keys() - done.keys():  # nothing of this call left running
                self.engine.abort(rid)
            raise
        pad = getattr(self.engine, "pad_token_id", 0)
        return self._to_device(rollouts_from_outputs([done[rid] for g in own for rid in ids[g]], pad))

    def greedy(self, prompts: list[list[int]]) -> Rollouts:
        """One greedy response per prompt (eval, ReMax baselines)."""
        params = SamplingParams(temperature=0.0, max_tokens=self.sampling.max_tokens,
                                stop_token_ids=self.sampling.stop_token_ids)
        return self.engine.generate(prompts, params)

    def check_on_policy(self, rollouts: Rollouts) -> None:
        """Raise unless every token of ``rollouts`` was sampled with the weights of the last
        refit (``Rollouts.token_versions``: a refit mid-generation shows up here)."""
        versions = rollouts.response_versions()
        if self.expected_version is None or versions != {self.expected_version}:
            shown = rollouts.weight_version if len(versions) <= 1 else sorted(versions)
            raise StaleRolloutError(
                f"rollouts were generated with engine weight_version {shown}, but the policy "
                f"being trained was refit as version {self.expected_version}: the engine was updated outside "
                "RolloutWorker.refit or the step order changed; refit before sampling")

    def _to_device(self, ro: Rollouts) -> Rollouts:
        return rollouts_to_device(ro, self.device)


def _is_fsdp_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 cannot have sharded it
        return False
    return isinstance(model, FSDPModule)


def sampling_params(rollout: RolloutConfig, eos_token_id: int | None) -> SamplingParams:
    """The one translation of ``rollout.*`` into engine sampling settings (training and
    ``hybridrl eval`` alike); the per-prompt seed is set at sampling time."""
    return SamplingParams(temperature=rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p,
                          max_tokens=rollout.max_tokens, n=rollout.n,
                          stop_token_ids=(eos_token_id,) if eos_token_id is not None else ())
