"""Refit from an FSDP2-sharded trainer: parameters are all-gathered bucket by bucket
into this rank's engine through the same ``begin → load → finish`` protocol (and its
verifier). Peak extra memory per rank: one bucket of full tensors plus the parameter
being gathered — never the unsharded model."""

from __future__ import annotations

import torch

from hybridrl.distributed.fsdp import iter_full_parameter_buckets
from hybridrl.refit import Refit, RefitStats


def refit_sharded(engine, model: torch.nn.Module, *, bucket_bytes: int, verify: bool = False) -> RefitStats:
    names = [n for n, _ in model.named_parameters()]
    refit = Refit(engine, verify=verify).begin(names)
    try:
        for bucket in iter_full_parameter_buckets(model, bucket_bytes):  # one all-gather per bucket, every rank
            refit.load(bucket)
    except BaseException:
        refit.abort()
        raise
    return refit.finish()
