"""Refit from FSDP2 shards straight into tensor-parallel engine shards.

FSDP2 holds parameter rows ``[r·c, (r+1)·c)`` on rank ``r`` (``Shard(0)``, ``c = ceil(d0 /
N)``); a TP engine rank holds a :class:`TPSlice` of each HF tensor (rows of a column-parallel
weight, columns of a row-parallel one, both halves of a fused ``gate_up_proj``, or all of a
replicated one). Every rank knows every rank's slice (one ``all_gather_object`` of the route
slices per refit) and every rank's FSDP rows, so for each bucket of parameters each rank
sends every destination exactly the intersection of its rows with the destination's slice,
and receives exactly its own slice, in **one ``all_to_all_single`` per bucket** (per dtype).
No rank ever holds a full parameter, let alone the model: the peak extra memory per rank is
the bucket's send buffer (its own rows, as many times as destinations need them) plus its
TP slices. The engine receives tensors of ``route.local_shape`` and goes through the same
refit protocol and verifier as every other refit.

Compared with gathering each bucket whole and letting every engine slice it
(``distributed/refit.py``), a rank receives ``1/T`` of the split weights instead of all of
them. On NCCL the same exchange is one ``all_to_all`` per bucket (bandwidth ~ bytes moved);
on gloo (the CPU tests) it runs pairwise over TCP and is no faster than the all-gather: the
memory bound is the point there (``benchmarks/tensor_parallel.py`` measures both).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridrl.distributed.fsdp import _dim0_rows, full_tensor
from hybridrl.distributed.refit import refit_buckets
from hybridrl.refit import RefitStats
from hybridrl.refit.bucket import group_by_bytes
from hybridrl.rollout.layers.tensor_parallel import TPSlice


def refit_sharded_tp(engine, model: torch.nn.Module, *, bucket_bytes: int, verify: bool = False,
                     version: int | None = None) -> RefitStats:
    """Refit ``engine`` (this rank's TP shard) from the FSDP2-sharded ``model``; every rank calls it."""
    params = [(n, p.detach()) for n, p in model.named_parameters()]
    routes = engine.weight_routes

    def buckets():
        mine = {n: _route_slice(routes, n) for n, _ in params}
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)  # each rank's slice of each name
        for bucket in group_by_bytes(params, bucket_bytes):  # whole-tensor bytes: a bound on what arrives
            yield _exchange(bucket, every, routes)

    return refit_buckets(engine, model, buckets, verify=verify, version=version)  # buffers: whole, sliced by the engine


def _route_slice(routes, name: str):
    if name in routes.ignored or name not in routes:
        return "skip"  # a tied head (the refit accepts and skips it); unknown names fail in load()
    tp = routes[name].tp
    return None if tp is None else (tp.dim, tp.pieces)


def _exchange(bucket, every: list, routes) -> list[tuple[str, torch.Tensor]]:
    """This rank's slices of the bucket's parameters (see the module docstring)."""
    world, me = dist.get_world_size(), dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    exchanged = []
    for name, p in bucket:
        if every[me][name] == "skip":
            continue
        if isinstance(p, DTensor) and len(p.placements) == 1 and p.placements[0].is_shard(0):
            exchanged.append((name, p))
        else:  # replicated or another layout: whole, then the engine takes its part (collective in order)
            out[name] = full_tensor(p)
    by_dtype: dict[torch.dtype, list] = {}
    for name, p in exchanged:
        by_dtype.setdefault(p.dtype, []).append((name, p))
    for dtype in sorted(by_dtype, key=str):
        out.update(_all_to_all(by_dtype[dtype], every, world, me))
    return [(n, out[n]) for n, _ in bucket if n in out]


def _slice_of(entry) -> TPSlice | None:
    return None if entry is None else TPSlice(entry[0], tuple(tuple(x) for x in entry[1]))


def _part(local: torch.Tensor, rows: tuple[int, int], sl: TPSlice | None) -> list[torch.Tensor]:
    """What a rank holding ``rows`` of a tensor sends a rank needing ``sl`` (one piece per
    needed row range for a dim-0 slice, else one block), as a list of tensors."""
    a, b = rows
    if sl is None:
        return [local]
    if sl.dim == 0:
        pieces = []
        for s, n in sl.pieces:
            lo, hi = max(s, a), min(s + n, b)
            if hi > lo:
                pieces.append(local[lo - a:hi - a])
        return pieces
    return [sl.take(local)]


def _part_numel(shape: torch.Size, rows: tuple[int, int], sl: TPSlice | None) -> list[int]:
    a, b = rows
    inner = shape[1:].numel()
    if sl is None:
        return [(b - a) * inner]
    if sl.dim == 0:
        return [max(0, min(s + n, b) - max(s, a)) * inner for s, n in sl.pieces]
    return [(b - a) * sl.local_shape(shape)[1:].numel()]


def _all_to_all(params, every: list, world: int, me: int) -> dict[str, torch.Tensor]:
    """One exchange for same-dtype parameters. What a rank keeps of its own rows never enters
    the buffers (views of its shard); the rest goes through one flat send and one flat
    receive buffer, and a slice that arrives in one piece stays a view of the receive buffer."""
    rows = {n: _dim0_rows(p.shape[0], world) for n, p in params}
    local = {n: p.to_local() for n, p in params}
    send_parts, send_sizes = [], []
    for q in range(world):  # to each other destination: my rows of its slice, parameter by parameter
        parts = [] if q == me else [t.reshape(-1) for n, _ in params
                                    for t in _part(local[n], rows[n][me], _slice_of(every[q][n]))]
        send_parts.extend(parts)
        send_sizes.append(sum(t.numel() for t in parts))
    recv_sizes = [0 if r == me else sum(sum(_part_numel(p.shape, rows[n][r], _slice_of(every[me][n])))
                                        for n, p in params) for r in range(world)]
    device, dtype = local[params[0][0]].device, params[0][1].dtype
    send = torch.cat(send_parts) if send_parts else torch.empty(0, dtype=dtype, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes)
    del send, send_parts
    sources = list(recv.split(recv_sizes))
    offsets = [0] * world
    out = {}
    for n, p in params:
        sl = _slice_of(every[me][n])
        chunks = []  # per source, its pieces in piece order
        for r in range(world):
            if r == me:
                own = _part(local[n], rows[n][me], sl)
                chunks.append(_with_empty(own, _part_numel(p.shape, rows[n][me], sl), local[n]))
                continue
            sizes = _part_numel(p.shape, rows[n][r], sl)
            flat = sources[r][offsets[r]:offsets[r] + sum(sizes)]
            offsets[r] += sum(sizes)
            chunks.append(list(flat.split(sizes)))
        out[n] = _assemble(p.shape, sl, chunks, rows[n])
    return out


def _with_empty(parts: list[torch.Tensor], sizes: list[int], like: torch.Tensor) -> list[torch.Tensor]:
    """``_part``'s non-empty pieces re-aligned with ``_part_numel``'s sizes (empties where 0)."""
    it = iter(parts)
    return [next(it) if k else like.new_empty(0) for k in sizes]


def _assemble(shape: torch.Size, sl: TPSlice | None, chunks: list[list[torch.Tensor]],
              rows: list[tuple[int, int]]) -> torch.Tensor:
    """This rank's slice from every source's pieces (``chunks[r]``, in piece order); a slice
    that comes from one source is a view of it, not a copy."""
    if sl is None or sl.dim != 0:
        local = shape if sl is None else sl.local_shape(shape)
        blocks = [c[0].reshape(b - a, *local[1:]) for c, (a, b) in zip(chunks, rows) if b > a]
        return torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    inner = shape[1:]
    pieces = []
    for i in range(len(sl.pieces)):  # piece i: the sources' overlaps in row order
        pieces.extend(c[i].reshape(-1, *inner) for c in chunks if c[i].numel())
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]
