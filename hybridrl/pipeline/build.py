"""The run's batch source from its config: the one place ``trainer.mode`` is read.

    sync          staleness 0, one inline producer: the trainer's engine, stepped by the
                  trainer while it waits (a tensor-parallel group steps its shards together)
    one_step_off  staleness 1, producers refit between batches
    async         staleness ``pipeline.max_staleness``, producers refit at once

Producers (``pipeline.placement``; ``launcher.name=ray`` puts them in Ray actors) run
single-turn samples or agent episodes alike: the episode driver is part of every
producer's work runner when ``env.name`` is set. Every data-parallel rank builds its own
source over its share of the prompts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hybridrl.config import Config
from hybridrl.config.base import ConfigError
from hybridrl.pipeline.coordinator import Pipeline
from hybridrl.pipeline.engines import adapter_spec, build_engine, build_runner
from hybridrl.pipeline.producers import InlineProducer, LocalProducer
from hybridrl.pipeline.source import SourceSettings


@dataclass
class SourceParts:
    """What the source is built over (besides the config)."""

    local: Any  # the trainer's RolloutWorker
    groups: Any  # the kind of group (tasks.py)
    tokenizer: Any
    hf_config: Any
    longest_prompt: int
    device: torch.device
    console: Callable[[str], None]
    ranks: int = 1  # data-parallel ranks (each builds its own source)


def source_settings(cfg: Config, ranks: int) -> SourceSettings:
    p, t, d = cfg.pipeline, cfg.trainer, cfg.algo.dapo
    staleness = {"sync": 0, "one_step_off": 1}.get(t.mode, p.max_staleness)
    placement = ("a thread of the trainer process" if p.placement == "colocated" else
                 "Ray actors" if cfg.launcher.name == "ray" else "processes (weights by shared memory)")
    return SourceSettings(overlapped=t.mode != "sync", groups_per_step=cfg.batch.prompts_per_step // ranks,
                          max_staleness=staleness, partial=t.mode == "async", workers=1 if t.mode == "sync" else p.workers,
                          placement=placement, timeout_s=p.timeout_s, restarts=p.worker_restarts,
                          dynamic_sampling=d.dynamic_sampling, refill_rounds=d.refill_rounds)


def build_source(cfg: Config, parts: SourceParts) -> Pipeline:
    """The source; not started (``RLStep.start`` does, after the warm start or the resume)."""
    check_composable(cfg)
    settings = source_settings(cfg, parts.ranks)
    sharded = parts.ranks > 1
    if cfg.trainer.mode == "sync":
        make_producer, weights = _inline(cfg, parts), (lambda model: model)
    else:
        make_producer = _overlapped(cfg, parts, sharded)
        weights = _gathered(cfg, parts.local.lora) if sharded else (lambda model: model)
    return Pipeline(settings=settings, groups=parts.groups, local=parts.local, make_producer=make_producer,
                    weights=weights, device=parts.device, console=parts.console)


def check_composable(cfg: Config) -> None:
    """What the overlapped producers cannot run, one line each, with the reason."""
    if cfg.trainer.mode != "sync" and cfg.rollout.exact:
        raise ConfigError(f"rollout.exact with trainer.mode={cfg.trainer.mode}: not supported (stale weights are not "
                         "on-policy: exact means the trainer's bits at the version that trains them); set "
                         "rollout.exact=false or drop that setting")
    if cfg.trainer.mode != "sync" and cfg.rollout.tensor_parallel_size > 1:
        raise ConfigError(f"trainer.mode={cfg.trainer.mode} with rollout.tensor_parallel_size="
                         f"{cfg.rollout.tensor_parallel_size}: an overlapped producer runs a whole engine of its own "
                         "on its own thread or process, while a tensor-parallel engine's shards step together on the "
                         "ranks' trainer threads; use tensor_parallel_size=1 (each rank then overlaps its own engine) "
                         "or trainer.mode=sync")


def _inline(cfg: Config, parts: SourceParts):
    local = parts.local
    mesh = local.mesh
    lockstep, leader = (None, True) if mesh is None else (_tp_lockstep(mesh), mesh.tp.rank == 0)
    runner = build_runner(cfg, local.engine, parts.tokenizer, lockstep=lockstep, leader=leader)

    def make_producer(i, sink, wake):
        return InlineProducer(i, local, runner, sink)

    return make_producer


def _overlapped(cfg: Config, parts: SourceParts, sharded: bool):
    """Producers with engines of their own: a thread here, worker processes, or Ray actors."""
    from hybridrl.pipeline.remote import RefitPayload
    from hybridrl.pipeline.worker import WorkerSpec

    p, t = cfg.pipeline, cfg.trainer
    lora = None if sharded else parts.local.lora  # sharded: full gathered weights, published once per update
    device = parts.device
    if p.placement == "colocated":
        from hybridrl.trainer.rollout_worker import RolloutWorker
        from hybridrl.trainer.weight_sync import WeightSyncSpec

        def make_producer(i, sink, wake):
            engine = build_engine(cfg, parts.hf_config, device=device, ranks=1, longest_prompt=parts.longest_prompt,
                                  lora=parts.local.lora)
            spec = WeightSyncSpec(bucket_bytes=cfg.refit.bucket_mb << 20, verify=cfg.refit.verify, lora=lora,
                                  lora_mode=cfg.rollout.lora_mode)
            worker = RolloutWorker(engine, parts.local.sampling, device=device, sync=spec)
            return LocalProducer(i, worker, build_runner(cfg, engine, parts.tokenizer), sink, wake)

        return make_producer
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cores = max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))  # ranks on one host share them
    share = max(1, cores // (p.workers + 1))  # the cores this rank may run on, split evenly
    threads = p.worker_threads or t.threads or share
    if t.threads == 0:
        torch.set_num_threads(share)
    spec = WorkerSpec(cfg=cfg, hf_config=parts.hf_config, tokenizer=parts.tokenizer, device=str(device),
                      longest_prompt=parts.longest_prompt, threads=threads, verify=cfg.refit.verify,
                      timeout_s=p.timeout_s, adapter=adapter_spec(parts.local.lora, cfg.rollout.lora_mode))
    weights = full_weights if sharded else _whole

    if cfg.launcher.name == "ray":  # rollout workers as Ray actors, placed by Ray (weights: object store)
        from hybridrl.pipeline.ray_producer import RayProducer

        def make_producer(i, sink, wake):
            return RayProducer(i, spec, sink, wake, cpus=threads, gpus=1 if device.type == "cuda" else 0,
                               payload=RefitPayload(lora, cfg, weights))
    else:
        from hybridrl.pipeline.remote import RemoteProducer

        def make_producer(i, sink, wake):
            return RemoteProducer(i, spec, sink, wake, bucket_bytes=cfg.refit.bucket_mb << 20,
                                  payload=RefitPayload(lora, cfg, weights))
    return make_producer


def _whole(model_or_named) -> list:
    from hybridrl.refit.transport import named_trainer_tensors

    return named_trainer_tensors(model_or_named)


def full_weights(model) -> list:
    """The policy's whole tensors on the host, gathered from its FSDP2 shards (collective:
    every rank calls it at the same publication); a list passes through."""
    if not isinstance(model, torch.nn.Module):
        return model
    from hybridrl.distributed.fsdp import iter_full_parameter_buckets
    from hybridrl.refit.transport import named_persistent_buffers
    from hybridrl.trainer.weight_sync import is_fsdp_sharded

    if not is_fsdp_sharded(model):
        return [(n, t.detach().cpu().clone()) for n, t in _whole(model)]
    out = [(n, t.cpu()) for bucket in iter_full_parameter_buckets(model, 64 << 20) for n, t in bucket]
    return out + [(n, b.cpu().clone()) for n, b in named_persistent_buffers(model)]


def _gathered(cfg: Config, lora) -> Callable:
    """What producers load when the policy is sharded: its whole tensors gathered once per
    publication (with LoRA: the full payload, base and adapters or merged weights)."""
    if lora is None:
        return full_weights

    def payload(model):
        if not isinstance(model, torch.nn.Module):
            return model
        named, _ = lora.refit_payload(cfg.rollout.lora_mode, None, dtype=cfg.model.torch_dtype)
        return [(n, t.detach().cpu().clone()) for n, t in named]

    return payload


def _tp_lockstep(mesh):
    """Episodes of a tensor-parallel group: the leader's environment results, broadcast."""
    import torch.distributed as dist

    leader = dist.get_rank() - mesh.tp.rank

    def lockstep(events: list) -> list:
        box = [events if mesh.tp.rank == 0 else None]
        dist.broadcast_object_list(box, src=leader, group=mesh.tp.group)
        return box[0]

    return lockstep
