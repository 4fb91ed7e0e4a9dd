"""Refit from an FSDP2-sharded trainer: parameters are all-gathered bucket by bucket
into this rank's engine through the same ``begin → load → finish`` protocol (and its
verifier). Peak extra memory per rank: one bucket of full tensors plus the parameter
being gathered — never the unsharded model."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from hybridrl.distributed.fsdp import iter_full_parameter_buckets
from hybridrl.refit import Refit, RefitStats
from hybridrl.refit.transport import named_persistent_buffers


def refit_sharded(engine, model: torch.nn.Module, *, bucket_bytes: int, verify: bool = False,
                  version: int | None = None) -> RefitStats:
    return refit_buckets(engine, model, lambda: iter_full_parameter_buckets(model, bucket_bytes), verify=verify,
                         version=version)


def refit_buckets(engine, model: torch.nn.Module, buckets: Callable[[], Iterable[list]], *,
                  verify: bool = False, version: int | None = None) -> RefitStats:
    """One refit of ``engine`` from the sharded ``model``: announce every parameter and
    persistent buffer, load each bucket ``buckets()`` yields (collectives inside, in step on
    every rank), then the buffers (replicated on every rank: no gather); abort on any error.
    ``version``: the weight version this refit publishes (None: the engine's + 1)."""
    buffers = named_persistent_buffers(model)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in buffers]
    refit = Refit(engine, verify=verify, version=version).begin(names)
    try:
        for bucket in buckets():
            refit.load(bucket)
        if buffers:
            refit.load(buffers)
    except BaseException:
        refit.abort()
        raise
    return refit.finish()
