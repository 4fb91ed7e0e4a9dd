"""LoRA in the built-in engine: the base weights stay as loaded, each adapted linear adds
its low-rank term, ``y[:, rows_s] += scale · (x @ A_sᵀ) @ B_sᵀ`` for every adapted shard s.

One :class:`LoRAAdapter` hangs off an engine linear (``LinearBase.adapter``) and covers
the HF modules fused into it (``q_proj`` / ``k_proj`` / ``v_proj`` of one ``qkv_proj``):

- ``lora_A [S·r, in]``: the adapted shards' A stacked, so one matmul serves all of them;
- ``lora_B [out, r]``: shard s's B in the rows of its fused output (``shard_slice``).

Both are allocated once, when the engine is built, and every refit writes them in place
(a captured CUDA graph keeps reading the same addresses). Routes: ``X.lora_A.weight`` /
``X.lora_B.weight`` of HF module ``X``, validated and verified like every other weight.

Tensor parallel: a column-parallel layer holds B's rows of its output share and the whole
A; a row-parallel one holds A's columns of its input share and the whole B, and adds its
partial ``(x_t @ A_tᵀ) @ Bᵀ`` before the layer's all-reduce — the sum over ranks is the
full product, so the adapter costs no extra collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridrl.exact.ops import padded_linear
from hybridrl.rollout.layers.exact_linear import ExactLinearMethod
from hybridrl.rollout.layers.tensor_parallel import TPSlice


@dataclass(frozen=True)
class AdapterSpec:
    """The adapters an engine is built to apply: ``rank``, ``scale`` (alpha / rank) and the
    HF module names ``modules`` that carry one (``lora/targets.py`` resolves them)."""

    rank: int
    scale: float
    modules: tuple[str, ...]


class LoRAAdapter(nn.Module):
    """The adapters of one engine linear, for ``shards``: ``{shard_id: HF module name}``."""

    def __init__(self, layer, shards: dict, rank: int, scale: float):
        """In the layer's dtype: the engine's activation dtype (also over FP8 base weights)."""
        super().__init__()
        self.rank, self.scale = rank, scale
        # exact numerics (the layer multiplies batch-invariantly): peft's forward, op for op,
        # over the float32 adapters peft keeps (also over a bf16 base: ``autocast_adapter_dtype``)
        self.exact = isinstance(layer.method, ExactLinearMethod)
        dtype, device = adapter_dtype(layer.dtype, self.exact), layer.weight.device
        self.shard_ids = list(shards)
        self.hf_modules = dict(shards)
        self.rows = [layer.shard_slice(s) for s in self.shard_ids]
        S = len(self.shard_ids)
        self.lora_A = nn.Parameter(torch.zeros(S * rank, layer.input_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.lora_B = nn.Parameter(torch.zeros(layer.output_size, rank, dtype=dtype, device=device),
                                   requires_grad=False)
        a_rows = {s: slice(j * rank, (j + 1) * rank) for j, s in enumerate(self.shard_ids)}
        b_rows = dict(zip(self.shard_ids, self.rows))
        self.lora_A.weight_loader = lambda p, w, shard_id: p.data[a_rows[shard_id]].copy_(w)
        self.lora_B.weight_loader = lambda p, w, shard_id: p.data[b_rows[shard_id]].copy_(w)
        self._a_rows, self._b_rows = a_rows, b_rows
        # HF shapes and tensor-parallel slices, per shard
        self._hf_in = layer.hf_input_size
        self._hf_out = {s: layer.hf_output_sizes[layer._shard_index(s)] for s in self.shard_ids}
        self._tp_a, self._tp_b = {}, {}
        for s in self.shard_ids:
            tp = layer.tp_slices[layer._shard_index(s)]
            self._tp_a[s] = TPSlice(1, tp.pieces) if tp is not None and tp.dim == 1 else None
            self._tp_b[s] = TPSlice(0, tp.pieces) if tp is not None and tp.dim == 0 else None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output ``[..., out]``) plus the adapters' terms, in place."""
        r = self.rank
        if self.exact:  # peft's ``result + lora_B(lora_A(x)) * scaling`` per HF module, each GEMM row-tiled
            x = x.to(self.lora_A.dtype)  # peft's _cast_input_dtype
            for j, rows in enumerate(self.rows):
                update = padded_linear(padded_linear(x, self.lora_A[j * r:(j + 1) * r]), self.lora_B[rows])
                y[..., rows] = (y[..., rows] + update * self.scale).to(y.dtype)  # promoted, then peft's cast back
            return y
        z = x.to(self.lora_A.dtype) @ self.lora_A.t()  # [..., S·r]
        for j, rows in enumerate(self.rows):
            update = (z[..., j * r:(j + 1) * r] @ self.lora_B[rows].t()) * self.scale
            y[..., rows] += update.to(y.dtype)
        return y

    def hf_weight_routes(self, module_name: str):
        """Two routes per adapted shard: ``X.lora_A.weight [r, in]`` and ``X.lora_B.weight [out, r]``."""
        from hybridrl.rollout.weight_routes import WeightRoute

        for s in self.shard_ids:
            X = self.hf_modules[s]
            yield WeightRoute(f"{X}.lora_A.weight", f"{module_name}.lora_A", s, torch.Size([self.rank, self._hf_in]),
                              self.lora_A, self._a_rows[s], None, self._tp_a[s])
            yield WeightRoute(f"{X}.lora_B.weight", f"{module_name}.lora_B", s,
                              torch.Size([self._hf_out[s], self.rank]), self.lora_B, self._b_rows[s], None,
                              self._tp_b[s])


def adapter_dtype(engine_dtype: torch.dtype, exact: bool) -> torch.dtype:
    """The dtype an engine holds its adapters in: its own, or under exact numerics float32,
    the dtype peft trains them in (a refit must then send them uncast)."""
    return torch.float32 if exact else engine_dtype


def attach_adapters(model: nn.Module, routes, spec: AdapterSpec) -> None:
    """Give every engine linear that computes one of ``spec.modules`` its :class:`LoRAAdapter`.

    ``routes``: the engine's route table *before* adapters (it says which linear and fused
    shard each HF ``X.weight`` lands in). A module the engine does not run as a plain
    matmul — MLA's ``kv_b_proj`` (folded into the absorbed attention caches), a grouped or
    vocabulary-parallel projection — raises a one-line ValueError naming it."""
    from hybridrl.rollout.layers.linear import LinearBase

    per_layer: dict[str, dict] = {}
    for X in spec.modules:
        route = routes[f"{X}.weight"] if f"{X}.weight" in routes else None
        layer = None if route is None else model.get_submodule(route.param_name.rsplit(".", 1)[0])
        if not isinstance(layer, LinearBase) or not getattr(layer, "adapter_capable", True):
            why = getattr(layer, "adapter_capable_why", "it is not one of the engine's plain linear layers")
            raise ValueError(f"model.lora.target_modules: the built-in engine cannot apply an adapter to {X} ({why}); "
                             "use rollout.lora_mode=merged, or leave it out of model.lora.target_modules")
        per_layer.setdefault(route.param_name.rsplit(".", 1)[0], {})[route.shard_id] = X
    for layer_name, shards in per_layer.items():
        layer = model.get_submodule(layer_name)
        layer.adapter = LoRAAdapter(layer, shards, spec.rank, spec.scale)
