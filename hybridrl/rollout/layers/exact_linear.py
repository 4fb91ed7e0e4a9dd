"""The batch-invariant linear method (``rollout.exact`` on the built-in engine).

Plain engine-dtype weights, stored and loaded as :class:`UnquantizedLinearMethod`'s (a fused
``qkv_proj`` / ``gate_up_proj`` holds its shards' rows one after another), multiplied the way
the trainer's transformers modules multiply under ``hybridrl.exact``: one GEMM per Hugging
Face shard (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``), each over the
shard's rows of the fused weight (a contiguous view: the same ``[N, K]`` operand the trainer's
``nn.Linear`` holds), rows zero-padded into ``GEMM_TILE``-row tiles
(:func:`hybridrl.exact.ops.padded_linear`).

Why per shard: the BLAS may pick its kernel from the whole shape, ``N`` included, so a fused
GEMM's columns need not carry the unfused GEMMs' bits. Where they do — probed once per
(shard widths, K, dtype, bias, device) on this machine's kernels, :func:`fused_is_exact` —
the layer runs its one fused GEMM instead (3 GEMM calls become 1 in ``qkv_proj``). The probe
compares whole tiles of random operands: which kernel a GEMM runs, and so its reduction
order, is chosen from shapes and strides, never from values.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hybridrl.exact.ops import GEMM_TILE, padded_linear
from hybridrl.rollout.layers.linear_method import UnquantizedLinearMethod

PROBE_SEEDS = (0, 1)  # two draws of operands per shape


@functools.cache
def fused_is_exact(shard_sizes: tuple[int, ...], k: int, dtype: torch.dtype, bias: bool, device: str) -> bool:
    """Whether one ``GEMM_TILE``-row GEMM over the fused ``[sum(shard_sizes), k]`` weight gives
    every shard's columns the bits of that shard's own GEMM (separately allocated operands, as
    the trainer's modules hold them) on this machine."""
    for seed in PROBE_SEEDS:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(GEMM_TILE, k, generator=g).to(device, dtype)
        ws = [torch.randn(n, k, generator=g).to(device, dtype) for n in shard_sizes]
        bs = [torch.randn(n, generator=g).to(device, dtype) if bias else None for n in shard_sizes]
        fused = F.linear(x, torch.cat(ws), torch.cat(bs) if bias else None)
        alone = torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], dim=-1)
        if not torch.equal(fused, alone):
            return False
    return True


class ExactLinearMethod(UnquantizedLinearMethod):
    """``y = x @ W.T + b`` shard by shard (or fused where probed equal), each a row-tiled GEMM."""

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        if len(layer.shard_names) == 1 or fused_is_exact(tuple(layer.output_sizes), layer.input_size,
                                                         layer.weight.dtype, layer.bias is not None,
                                                         str(layer.weight.device)):
            return padded_linear(x, layer.weight, layer.bias)
        outs = []
        for name in layer.shard_names:
            rows = layer.shard_slice(name)
            bias = None if layer.bias is None else layer.bias[rows]
            outs.append(padded_linear(x, layer.weight[rows], bias))
        return torch.cat(outs, dim=-1)
