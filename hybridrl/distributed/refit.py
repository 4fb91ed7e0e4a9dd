"""Refit from an FSDP2-sharded trainer: parameters are all-gathered bucket by bucket
into this rank's engine through the same ``begin → load → finish`` protocol (and its
verifier). Peak extra memory per rank: one bucket of full tensors plus the parameter
being gathered — never the unsharded model."""

from __future__ import annotations

import torch

from hybridrl.distributed.fsdp import iter_full_parameter_buckets
from hybridrl.refit import Refit, RefitStats
from hybridrl.refit.transport import named_persistent_buffers


def refit_sharded(engine, model: torch.nn.Module, *, bucket_bytes: int, verify: bool = False) -> RefitStats:
    buffers = named_persistent_buffers(model)  # replicated on every rank: no gather
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in buffers]
    refit = Refit(engine, verify=verify).begin(names)
    try:
        for bucket in iter_full_parameter_buckets(model, bucket_bytes):  # one all-gather per bucket, every rank
            refit.load(bucket)
        if buffers:
            refit.load(buffers)
    except BaseException:
        refit.abort()
        raise
    return refit.finish()
