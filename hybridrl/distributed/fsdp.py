"""FSDP2 sharding of the trainer's models and gathering them back, one tensor at a time."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator, Mapping

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor


def shard_model(model: torch.nn.Module, forward_methods: Mapping[str, Callable] | None = None) -> torch.nn.Module:
    """``fully_shard`` every decoder layer, then the root (embeddings, norm, head).

    ``forward_methods``: ``{attribute: fn(model, *args, **kwargs)}`` installed on the root
    and registered as FSDP forward methods (see below).

    Per-layer units keep peak memory at one layer's full weights during forward/backward.
    Gradients are averaged over ranks (FSDP's default); the losses are normalized by the
    global batch and multiplied by ``dp_size`` (``GlobalBatchInfo``), so the averaged
    gradient is the gradient of the global batch's loss; see ``algos/aggregation.py``.
    """
    for layer in _decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    # Our forward passes call the backbone and the lm_head weight directly (vocabulary-
    # chunked log-probs), not ``model.forward``: each such entry point is installed as a
    # method and registered, so FSDP unshards the root's parameters around it.
    for name, fn in (forward_methods or {}).items():
        setattr(model, name, types.MethodType(_fresh_outputs(fn), model))
        register_fsdp_forward_method(model, name)
    if hasattr(model, "values"):  # the critic's value model
        register_fsdp_forward_method(model, "values")
    return model


def _fresh_outputs(fn: Callable) -> Callable:
    """FSDP hooks the outputs of a forward method; a view output would let a later in-place
    op drop that hook, so the (small, ``[B, L]``) outputs are returned as fresh tensors."""

    def method(self, *args, **kwargs):
        return tuple(t.clone() for t in fn(self, *args, **kwargs))

    return method


# the repeated blocks each FSDP unit wraps: a causal LM's decoder layers; a vision-language
# model's language layers and vision-tower blocks (transformers 5's Qwen-VL layout)
LAYER_PATHS = (("model.layers",), ("layers",), ("backbone.layers",), ("model.language_model.layers", "model.visual.blocks"))


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for paths in LAYER_PATHS:
        found = [_lookup(model, path) for path in paths]
        if all(node is not None for node in found):
            return [layer for node in found for layer in node]
    return []


def _lookup(model: torch.nn.Module, path: str):
    node = model
    for part in path.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for a DTensor shard; every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def iter_full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` in ``named_parameters`` order, gathered one at a time: the
    caller decides how many to hold (a refit bucket), never the whole model."""
    for name, p in model.named_parameters():
        yield name, full_tensor(p.detach())


def iter_full_parameter_buckets(model: torch.nn.Module, bucket_bytes: int
                                ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Chunks of ``(name, full tensor)``, gathered with ONE all-gather per chunk of small
    parameters (not one per parameter: on gloo a collective is latency-bound) and one per
    large parameter. Every rank must iterate it in step.

    Memory: a chunk of small parameters holds at most ``bucket_bytes / 2`` of full tensors
    plus the same again as the gather buffer; a parameter larger than ``bucket_bytes / 2``
    is gathered alone. So the peak stays within one bucket + the largest parameter.
    Each rank packs its dim-0 shards (FSDP2's ``Shard(0)``: rank r holds rows
    ``[r·c, min((r+1)·c, d0))``, ``c = ceil(d0 / world)``) into one flat buffer padded to
    the largest rank's size; each full tensor is reassembled from every rank's slice.
    """
    import torch.distributed as dist

    half = max(bucket_bytes // 2, 1)
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, p in model.named_parameters():
        p = p.detach()
        nbytes = p.numel() * p.element_size()
        if nbytes > half:
            if chunk:
                yield _gather_bucket(chunk, dist)
                chunk, size = [], 0
            yield [(name, full_tensor(p))]
            continue
        if size + nbytes > half and chunk:
            yield _gather_bucket(chunk, dist)
            chunk, size = [], 0
        chunk.append((name, p))
        size += nbytes
    if chunk:
        yield _gather_bucket(chunk, dist)


def _dim0_rows(d0: int, world: int) -> list[tuple[int, int]]:
    c = -(-d0 // world) if d0 else 0
    return [(min(r * c, d0), min((r + 1) * c, d0)) for r in range(world)]


def _gather_bucket(bucket: list[tuple[str, torch.Tensor]], dist) -> list[tuple[str, torch.Tensor]]:
    sharded = [(n, p) for n, p in bucket if isinstance(p, DTensor)]
    if not sharded:
        return bucket
    world = dist.get_world_size()
    dtype = sharded[0][1].dtype
    if any(p.dtype != dtype for _, p in sharded) or any(
            len(p.placements) != 1 or not p.placements[0].is_shard(0) for _, p in sharded):
        return [(n, full_tensor(p)) for n, p in bucket]  # mixed dtypes / other layouts: one by one
    inner = {n: p.shape[1:].numel() for n, p in sharded}
    per_rank = [sum((hi - lo) * inner[n] for n, p in sharded for lo, hi in [_dim0_rows(p.shape[0], world)[r]])
                for r in range(world)]
    width = max(per_rank)
    local = torch.cat([p.to_local().reshape(-1) for _, p in sharded]) if sharded else None
    send = torch.zeros(width, dtype=dtype, device=local.device)
    send[: local.numel()] = local
    recv = torch.empty(world * width, dtype=dtype, device=local.device)
    dist.all_gather_into_tensor(recv, send)
    slabs = recv.view(world, width)
    offsets = [0] * world
    full: dict[str, torch.Tensor] = {}
    for n, p in sharded:
        pieces = []
        for r, (lo, hi) in enumerate(_dim0_rows(p.shape[0], world)):
            k = (hi - lo) * inner[n]
            pieces.append(slabs[r, offsets[r]: offsets[r] + k])
            offsets[r] += k
        full[n] = torch.cat(pieces).view(p.shape)
    return [(n, full.get(n, p)) for n, p in bucket]


def grad_norm_value(norm: torch.Tensor) -> float:
    return float(full_tensor(norm))
