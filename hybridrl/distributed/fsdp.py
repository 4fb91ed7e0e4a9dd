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


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for path in ("model.layers", "layers", "backbone.layers"):
        node = model
        try:
            for part in path.split("."):
                node = getattr(node, part)
        except AttributeError:
            continue
        return list(node)
    return []


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


def grad_norm_value(norm: torch.Tensor) -> float:
    return float(full_tensor(norm))
