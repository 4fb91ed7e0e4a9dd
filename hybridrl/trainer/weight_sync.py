"""How the trainer's weights reach an engine in this process: one interface, one
implementation per path, chosen once when the rollout worker is built (never by probing
the engine per call).

    sync = weight_sync_for(engine, WeightSyncSpec(...))
    stats = sync.push(model, version)      # the engine now holds ``model`` as ``version``

Every implementation goes through the refit protocol (``begin -> load* -> finish``, the
verifier when ``refit.verify``) and hands the engine the ``version`` the batch source
decided (``pipeline/source.py``): the engine records it, nothing here computes one.

- :class:`FullSync`: whole tensors of an unsharded model (bucketed, in place).
- :class:`FsdpSync`: an FSDP2-sharded model, gathered bucket by bucket
  (``distributed/refit.py``); collective: every rank pushes together.
- :class:`TensorParallelSync`: FSDP2 shards straight into this rank's tensor-parallel
  engine shard (``distributed/tp_refit.py``); collective.
- :class:`LoRASync`: the adapters (or the merged targeted weights) only, the whole base
  only to an engine that does not hold the current base.

The transports to other processes (shared memory to a worker process, Ray's object store
to an actor) implement the same ``push`` in ``pipeline/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hybridrl.refit import RefitStats, refit_from_model


class WeightSync(Protocol):
    def push(self, model: torch.nn.Module, version: int) -> RefitStats:
        """Write ``model``'s weights into the engine, numbered ``version``."""


@dataclass(frozen=True)
class WeightSyncSpec:
    """What picks and configures the path (``refit.*``, the run's layout)."""

    bucket_bytes: int
    verify: bool
    sharded: bool = False  # the trainer's model is FSDP2-sharded once RL starts (several ranks)
    tensor_parallel: bool = False  # the engine is this rank's shard of a tensor-parallel engine
    lora: object = None  # the policy's LoRAPolicy when it trains adapters
    lora_mode: str = "adapter"


class FullSync:
    def __init__(self, engine, spec: WeightSyncSpec):
        self.engine, self.spec = engine, spec

    def push(self, model, version: int) -> RefitStats:
        return refit_from_model(self.engine, model, bucket_bytes=self.spec.bucket_bytes, verify=self.spec.verify,
                                version=version)


class FsdpSync(FullSync):
    """Gathers the shards bucket by bucket; before ``shard_for_data_parallel`` (the warm
    start's refit) the model is whole and goes as :class:`FullSync` sends it."""

    def push(self, model, version: int) -> RefitStats:
        if not is_fsdp_sharded(model):
            return super().push(model, version)
        from hybridrl.distributed.refit import refit_sharded

        return refit_sharded(self.engine, model, bucket_bytes=self.spec.bucket_bytes, verify=self.spec.verify,
                             version=version)


class TensorParallelSync(FullSync):
    """FSDP2 shards -> this rank's TP shard; a whole model (before sharding, or a single
    rank) is sliced by the engine itself."""

    def push(self, model, version: int) -> RefitStats:
        if not is_fsdp_sharded(model):
            return super().push(model, version)
        from hybridrl.distributed.tp_refit import refit_sharded_tp

        return refit_sharded_tp(self.engine, model, bucket_bytes=self.spec.bucket_bytes, verify=self.spec.verify,
                                version=version)


class LoRASync:
    """The base is frozen: after the engine's first load a refit is *partial* — the
    adapters or the merged targets only (a few MB), verified like a full one."""

    def __init__(self, engine, spec: WeightSyncSpec):
        self.engine, self.spec = engine, spec
        self.held_base: int | None = None  # the base version the engine holds (None: nothing yet)

    def push(self, model, version: int) -> RefitStats:
        lora = self.spec.lora
        dtype = getattr(self.engine, "adapter_dtype", getattr(self.engine, "dtype", None))  # what it holds them in
        named, partial = lora.refit_payload(self.spec.lora_mode, self.held_base,  # whole tensors (FSDP2: gathered)
                                            dtype=dtype)
        stats = refit_from_model(self.engine, named, bucket_bytes=self.spec.bucket_bytes, verify=self.spec.verify,
                                 partial=partial, version=version)
        self.held_base = lora.base_version
        return stats


def weight_sync_for(engine, spec: WeightSyncSpec) -> WeightSync:
    """The one path for ``engine`` and the run's layout."""
    if spec.lora is not None:
        return LoRASync(engine, spec)
    if spec.tensor_parallel and getattr(engine, "takes_tp_slices", False):
        return TensorParallelSync(engine, spec)
    if spec.sharded:
        return FsdpSync(engine, spec)
    return FullSync(engine, spec)


def is_fsdp_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 cannot have sharded it
        return False
    return isinstance(model, FSDPModule)
