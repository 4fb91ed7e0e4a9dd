"""The process group of a data-parallel job, from the launcher's environment.

torchrun, the elastic launcher and our Ray workers all set ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init_from_env` joins that
group (gloo on CPU, NCCL on CUDA) with a collective timeout, so a rank that dies takes
the others down within the timeout instead of hanging them.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` items (``n`` divisible by the world size)."""
        per = n // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)


def launched_distributed() -> bool:
    """True inside a multi-rank launch (the launcher set WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env(device: str, *, timeout_s: float) -> DistContext:
    """Join the launcher's process group; ``device`` ``cpu`` → gloo, ``cuda`` → NCCL on cuda:LOCAL_RANK."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def comm_device() -> torch.device:
    """Where small host-side values go for a collective: NCCL needs CUDA tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_module_(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank's (unsharded) ``module`` equal to rank ``src``'s, in place."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src)


def all_reduce_metrics(metrics: dict[str, float], *, summed: frozenset[str]) -> dict[str, float]:
    """Global metrics: keys in ``summed`` are added over ranks (already normalized by the
    global batch), extremes (``*_max`` / ``*_min``, ``algos/metrics.py``) take the max / min
    over ranks, every other one is averaged (ranks hold equal numbers of rows)."""
    import zlib

    from hybridrl.algos.metrics import extreme

    keys = sorted(metrics)
    world = dist.get_world_size()
    # the last slot checks that every rank reduced the same keys (in one collective, no pickling)
    signature = float(zlib.crc32("\n".join(keys).encode()))
    t = torch.tensor([float(metrics[k]) for k in keys] + [signature], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t)
    values = t.cpu().tolist()
    if values[-1] != signature * world:
        raise RuntimeError("data-parallel ranks logged different metric keys this step; every rank must run "
                           "the same phases")
    out = {k: (v if k in summed else v / world) for k, v in zip(keys, values[:-1])}
    for kind, op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):  # after the key check
        picked = [k for k in keys if extreme(k) == kind]
        if picked:
            t = torch.tensor([float(metrics[k]) for k in picked], dtype=torch.float64, device=comm_device())
            dist.all_reduce(t, op=op)
            out.update(zip(picked, t.cpu().tolist()))
    return out


def all_gather_floats(values: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's 1-D float tensor (equal lengths), in rank order."""
    values = values.to(comm_device()).contiguous()
    out = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(out, values)
    return torch.cat(out).cpu()


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's ``value``."""
    t = torch.tensor([value], dtype=torch.long, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def union_of_keys(metrics: dict[str, float], missing: float = 0.0) -> dict[str, float]:
    """``metrics`` with every key some rank logged (``missing`` where this rank did not: a
    count of a kind it never saw, e.g. ``agent/tool_errors/<kind>``)."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(metrics))
    keys = set().union(*every)
    return {k: metrics.get(k, missing) for k in sorted(keys)}


def all_gather_values(values: list[float]) -> list[float]:
    """Every rank's list (any lengths), concatenated in rank order."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, list(values))
    return [v for part in every for v in part]
