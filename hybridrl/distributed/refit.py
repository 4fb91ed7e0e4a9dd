"""Refit from an FSDP2-sharded trainer: parameters are all-gathered bucket by bucket
into this rank's engine through the same ``begin → load → finish`` protocol (and its
verifier). Peak extra memory per rank: one bucket of full tensors plus the parameter
being gathered — never the unsharded model."""

from __future__ import annotations

import torch

from hybridrl.distributed.fsdp import iter_full_parameters
from hybridrl.refit import Refit, RefitStats
from hybridrl.refit.bucket import nbytes


def refit_sharded(engine, model: torch.nn.Module, *, bucket_bytes: int, verify: bool = False) -> RefitStats:
    names = [n for n, _ in model.named_parameters()]
    refit = Refit(engine, verify=verify).begin(names)
    try:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in iter_full_parameters(model):  # a collective per parameter, same order on every rank
            bucket.append((name, tensor))
            size += nbytes(tensor)
            if size >= bucket_bytes:
                refit.load(bucket)
                bucket, size = [], 0
        if bucket:
            refit.load(bucket)
    except BaseException:
        refit.abort()
        raise
    return refit.finish()
