"""Fused experts: every expert of a MoE layer in two stacked tensors (the layer and its routes).

Storage (inference layout, what ``torch._grouped_mm`` reads):

- ``gate_up_proj [E, 2I, H]`` — rows ``[0, I)`` are expert e's ``gate_proj``, ``[I, 2I)`` its ``up_proj``;
- ``down_proj [E, H, I]``.

These are exactly transformers >= 5's fused ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``
parameters, so the module's parameter names *are* the trainer's names. A *fused-MoE method*
owns the storage (as a linear method owns a linear's; ``fused_moe_method.py``): unquantized,
or MXFP4 (``mxfp4_moe.py``). The matmuls are ``moe_dispatch.py``'s: grouped, or under exact
numerics (``LayerContext.exact``) transformers' eager per-expert loop (``exact_experts``).

Routes (``FusedExperts.hf_weight_routes``): the fused names are the *expected* names; the
per-expert names of safetensors checkpoints on disk (``experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``) are *aliases* of slices of them. Loading either writes the same
storage in place: a checkpoint (per-expert) and a trainer (fused) refit the same engine.

Tensor parallel (``tensor_parallel.py``): every rank holds every expert, with its share of
the intermediate width (``gate_up_proj`` rows ``[t·I/T, (t+1)·I/T)`` of both halves,
``down_proj`` the same columns), so an expert's output on a rank is a partial sum that the
MoE block all-reduces once (with its shared experts'). Sharding the experts themselves
(expert parallel) would need an all-to-all dispatch of tokens to their experts' ranks;
with the expert counts we serve, TP keeps every rank's work equal whatever the routing and
needs no dispatch, which is also vLLM's default (``enable_expert_parallel`` off).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.layers.fused_moe_method import PROJS
from hybridrl.rollout.layers.moe_dispatch import exact_experts, fused_experts
from hybridrl.rollout.layers.tensor_parallel import TPSlice, take_local


class FusedExperts(nn.Module):
    """E experts of width I over hidden size H; ``forward(x, topk_ids, topk_weights)``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ctx: LayerContext, *,
                 swiglu_limit: float | None = None):
        """``intermediate_size``: the HF width I; this rank holds ``I / ctx.tp.size`` of it;
        the storage is ``ctx.moe_method``'s."""
        super().__init__()
        self.tp, self.hf_intermediate_size = ctx.tp, intermediate_size
        self.inter_start, local = ctx.tp.split(intermediate_size, f"{ctx.prefix}: the experts' intermediate size")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, local
        self.swiglu_limit = swiglu_limit
        self.dtype, self.prefix, self.method = ctx.dtype, ctx.prefix, ctx.moe_method
        self.exact = ctx.exact  # transformers' eager per-expert loop, batch-invariant (``exact_experts``)
        self.method.create_weights(self, ctx.dtype, ctx.device)

    # geometry
    def full_shape(self, proj: str) -> torch.Size:
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        return torch.Size([E, 2 * I, H] if proj == "gate_up_proj" else [E, H, I])

    def hf_shape(self, proj: str, expert: int | None, shard: int | None, local: bool = True) -> torch.Size:
        """The HF tensor's shape for (proj, expert, shard): this rank's part, or (``local=False``) whole."""
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size if local else self.hf_intermediate_size
        shape = torch.Size([E, 2 * I, H] if proj == "gate_up_proj" else [E, H, I])
        if expert is None:
            return shape
        return torch.Size([I, H]) if shard is not None else shape[1:]

    def tp_slice(self, proj: str, expert: int | None, shard: int | None) -> TPSlice | None:
        """The part of the HF tensor this rank holds (None without tensor parallelism)."""
        if self.tp.size == 1:
            return None
        s, n, I = self.inter_start, self.intermediate_size, self.hf_intermediate_size
        if proj == "down_proj":
            return TPSlice(2 if expert is None else 1, ((s, n),))
        if expert is None:
            return TPSlice(1, ((s, n), (I + s, n)))
        return TPSlice(0, ((s, n),))

    def rows(self, proj: str, shard: int | None) -> slice:
        """Rows of one expert's matrix holding ``shard`` (gate 0 / up 1 of ``gate_up_proj``)."""
        if shard is None:
            return slice(None)
        assert proj == "gate_up_proj" and shard in (0, 1), (proj, shard)
        return slice(shard * self.intermediate_size, (shard + 1) * self.intermediate_size)

    def slot(self, t: torch.Tensor, proj: str, expert: int | None, shard: int | None) -> torch.Tensor:
        """The view of a per-expert-stacked tensor ``t [E, N, *]`` a (expert, shard) write lands in."""
        if expert is None:
            assert shard is None, "a fused tensor covers both shards"
            return t
        return t[expert][self.rows(proj, shard)]

    def check_shape(self, proj, loaded, expert, shard) -> None:
        want = self.hf_shape(proj, expert, shard)
        if tuple(loaded.shape) != tuple(want):
            raise ValueError(f"weight for {self.prefix}.{proj} (expert {expert}, shard {shard}) has shape "
                             f"{tuple(loaded.shape)}, expected {tuple(want)}; check that the checkpoint "
                             "matches the engine config (num_experts, moe_intermediate_size)")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.method.compute_weights(self)
        if self.exact:
            assert self.swiglu_limit is None, f"{self.prefix}: the exact experts have no clamped SwiGLU"
            return exact_experts(x, w13, w2, topk_ids, topk_weights)
        return fused_experts(x, w13, w2, topk_ids, topk_weights, limit=self.swiglu_limit)

    def hf_weight_routes(self, module_name: str) -> Iterator["ExpertRoute"]:
        """Fused (expected) routes, then per-expert alias routes, for this layer at ``module_name``."""
        E = self.num_experts
        for proj in PROJS:
            fused = f"{module_name}.{proj}"
            param = self.method.loaded_param(self, proj)
            param_name = f"{module_name}.{_param_attr(self, param)}"
            yield ExpertRoute(fused, param_name, self.hf_shape(proj, None, None, local=False), param, self, proj,
                              None, None, None, tp=self.tp_slice(proj, None, None))
            parts = (("gate_proj", 0), ("up_proj", 1)) if proj == "gate_up_proj" else (("down_proj", None),)
            for e in range(E):
                for part, shard in parts:
                    yield ExpertRoute(f"{module_name}.{e}.{part}.weight", param_name,
                                      self.hf_shape(proj, e, shard, local=False), param, self, proj, e, shard, fused,
                                      tp=self.tp_slice(proj, e, shard))


def _param_attr(module: nn.Module, param: nn.Parameter) -> str:
    return next(n for n, p in module.named_parameters(recurse=False) if p is param)


@dataclass(frozen=True)
class ExpertRoute:
    """Where one HF expert tensor lands (the ``WeightRoute`` interface).

    ``canonical`` is None for a fused name (one of ``WeightRoutes.expected``); for a
    per-expert alias it is the fused name whose slice it writes: the alias set of a fused
    name, all written, completes that name.
    """

    hf_name: str
    param_name: str
    shape: torch.Size
    param: nn.Parameter
    layer: FusedExperts
    proj: str
    expert: int | None
    shard_id: int | None
    canonical: str | None
    rows: slice | None = None
    tp: TPSlice | None = None
    """the part of the HF tensor this rank holds (tensor parallel); None: all of it."""

    @property
    def local_shape(self) -> torch.Size:
        return self.shape if self.tp is None else self.tp.local_shape(self.shape)

    def load(self, tensor: torch.Tensor) -> None:
        tensor = take_local(tensor, self.shape, self.tp)
        self.layer.method.weight_loader(self.layer, self.proj, tensor, self.expert, self.shard_id)

    def expected_held(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = take_local(tensor, self.shape, self.tp)
        return self.layer.method.expected_held(self.layer, self.proj, tensor, self.expert, self.shard_id)

    def held(self) -> torch.Tensor:
        return self.layer.method.held(self.layer, self.proj, self.expert, self.shard_id)
