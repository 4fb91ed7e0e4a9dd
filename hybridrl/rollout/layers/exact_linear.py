"""The batch-invariant linear method (``rollout.exact`` on the built-in engine).

Plain engine-dtype weights, stored and loaded as :class:`UnquantizedLinearMethod`'s (a fused
``qkv_proj`` / ``gate_up_proj`` holds its shards' rows one after another), multiplied the way
the trainer's transformers modules multiply under ``hybridrl.exact``: **one GEMM per
Hugging Face shard** (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``), each
over the shard's rows of the fused weight (a contiguous view: the same ``[N, K]`` operand the
trainer's ``nn.Linear`` holds), rows zero-padded into ``GEMM_TILE``-row tiles
(:func:`hybridrl.exact.ops.padded_linear`). Why one GEMM per shard and not the fused one: the
BLAS picks its kernel from the whole shape, ``N`` included, so a fused GEMM's columns need
not carry the unfused GEMM's bits.
"""

from __future__ import annotations

import torch

from hybridrl.exact.ops import padded_linear
from hybridrl.rollout.layers.linear_method import UnquantizedLinearMethod


class ExactLinearMethod(UnquantizedLinearMethod):
    """``y = x @ W.T + b`` shard by shard, each a row-tiled GEMM (module doc)."""

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if len(layer.shard_names) == 1:
            return padded_linear(x, layer.weight, layer.bias)
        outs = []
        for name in layer.shard_names:
            rows = layer.shard_slice(name)
            bias = None if layer.bias is None else layer.bias[rows]
            outs.append(padded_linear(x, layer.weight[rows], bias))
        return torch.cat(outs, dim=-1)
