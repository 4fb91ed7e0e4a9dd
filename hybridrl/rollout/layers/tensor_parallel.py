"""Tensor parallelism for the built-in engine: the group, the shard arithmetic, the collectives.

The Megatron layout (what vLLM serves): a *column-parallel* linear holds a contiguous share
of the output rows (attention heads, MLP columns, experts' intermediate columns) and needs
no communication; a *row-parallel* linear holds the matching share of the input columns and
sums the ranks' partial outputs with one all-reduce (``o_proj``, ``down_proj``, the MoE
block once for experts + shared experts). The embedding and the LM head are split over the
vocabulary; the head's shards are all-gathered so that every rank samples from the same
``[B, V]`` logits (bitwise equal on every rank: an all-gather copies, and gloo's / NCCL's
ring all-reduce hands every rank the same sums), with the same per-request seeds.

KV heads: ``T`` ranks split ``KVH`` heads evenly when ``KVH % T == 0``; when ``T % KVH ==
0`` each KV head is *replicated* on ``T / KVH`` ranks (rank ``t`` holds head ``t // (T /
KVH)``), as vLLM does; anything else cannot be laid out and is refused at construction.

**What a rank takes of a Hugging Face tensor** is a :class:`TPSlice`: a dimension and the
``(start, length)`` pieces along it, concatenated in order (one piece for a plain split;
two for transformers' fused ``experts.gate_up_proj``, whose gate and up halves are split
separately). Routes (``weight_routes.py``) carry it, so a trainer may send the full HF
tensor (the engine takes its slice) or only the slice (the FSDP -> TP refit sends exactly
that; ``hybridrl/distributed/tp_refit.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPSlice:
    """The pieces of one HF tensor a rank holds: ``dim`` and ``(start, length)`` pieces."""

    dim: int
    pieces: tuple[tuple[int, int], ...]

    @property
    def length(self) -> int:
        return sum(n for _, n in self.pieces)

    def local_shape(self, full: torch.Size) -> torch.Size:
        shape = list(full)
        shape[self.dim] = self.length
        return torch.Size(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor (a view for one piece, else a concatenation)."""
        parts = [full.narrow(self.dim, s, n) for s, n in self.pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def take_local(t: torch.Tensor, full_shape: torch.Size, tp: TPSlice | None) -> torch.Tensor:
    """``t`` as this rank holds it: the full HF tensor is sliced; an already-local one passes."""
    if tp is None or tuple(t.shape) != tuple(full_shape) or tp.local_shape(full_shape) == full_shape:
        return t
    return tp.take(t)


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in its tensor-parallel group (``size`` 1: no parallelism, no group)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    """the ``torch.distributed`` process group of the ``size`` ranks (None when size == 1)."""

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TensorParallel: rank {self.rank} outside a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("TensorParallel: a group of several ranks needs its process group")

    # ---- shard arithmetic ------------------------------------------------------------
    def split(self, n: int, what: str) -> tuple[int, int]:
        """``(start, length)`` of this rank's even share of ``n`` (``what`` names it in errors)."""
        if n % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} does not divide {what} ({n}); "
                             "pick a size that divides it")
        per = n // self.size
        return self.rank * per, per

    def rows(self, n: int, what: str, dim: int = 0) -> TPSlice | None:
        """The even split of ``n`` rows (or columns: ``dim``); None when not parallel."""
        if self.size == 1:
            return None
        return TPSlice(dim, (self.split(n, what),))

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """``(first head, count)`` of the KV heads this rank holds (replicated when fewer than ranks)."""
        T = self.size
        if num_kv_heads % T == 0:
            return self.rank * (num_kv_heads // T), num_kv_heads // T
        if T % num_kv_heads == 0:
            return self.rank // (T // num_kv_heads), 1
        raise ValueError(f"tensor_parallel_size={T} can neither split nor replicate {num_kv_heads} KV heads; "
                         f"use a size that divides {num_kv_heads} or a multiple of it")

    # ---- collectives -----------------------------------------------------------------
    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place (identity when not parallel)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x [..., n]`` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def mark_split(param, hf_shape, tp_slice: TPSlice | None):
    """Mark a plain (non-linear) parameter that holds ``tp_slice`` of an HF tensor of
    ``hf_shape``, for its route (``weight_routes.py``); returns it. No-op for ``None``."""
    if tp_slice is not None:
        param.hf_shape, param.tp_slice = torch.Size(hf_shape), tp_slice
    return param


SINGLE = TensorParallel()
"""No tensor parallelism: every layer whole, no collectives."""


def vocab_share(vocab_size: int, tp: TensorParallel) -> tuple[int, int, int]:
    """``(start, length, padded rows)`` of this rank's vocabulary share: rows of
    ``ceil(V / T)`` each (the last rank's share may be shorter: its tail rows are padding,
    never looked up, their logits dropped after the gather)."""
    per = -(-vocab_size // tp.size)
    start = min(tp.rank * per, vocab_size)
    return start, min(per, vocab_size - start), per


def check_tensor_parallel(hf_config, size: int, quantization: str | None = None) -> None:
    """One-line ``ValueError`` for a model the built-in engine cannot split ``size`` ways
    (checked before anything is built; the layers repeat the arithmetic at construction)."""
    if size == 1:
        return
    from hybridrl.rollout.model_config import parse_hf_config

    cfg = parse_hf_config(hf_config)
    where = f"rollout.tensor_parallel_size={size} with {cfg.model_type}"
    widths = {"num_attention_heads": cfg.num_heads}
    if cfg.v4 is not None:  # heads split by o_groups (each rank whole groups); MoE in every layer
        widths["o_groups"] = cfg.v4.o_groups
    elif cfg.mla is None:
        widths["intermediate_size"] = cfg.intermediate_size
    elif cfg.moe_layers != tuple(range(cfg.num_layers)):
        widths["intermediate_size"] = cfg.intermediate_size
    if cfg.num_experts:
        widths["moe_intermediate_size"] = cfg.moe_intermediate_size
    if cfg.shared_expert_intermediate_size:
        widths["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    for key, n in widths.items():
        if n % size:
            raise ValueError(f"{where}: {key}={n} does not split {size} ways; use a size that divides it")
    if cfg.mla is None and cfg.v4 is None and cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ValueError(f"{where}: num_key_value_heads={cfg.num_kv_heads} can neither be split nor replicated "
                         f"{size} ways; use a size that divides it or a multiple of it")
    if cfg.o_bias or cfg.mlp_bias:
        raise ValueError(f"{where}: a bias on o_proj / down_proj would be added once per rank; use "
                         "rollout.tensor_parallel_size=1 for this model")
    dense = (quantization or "").split("+")[0] or None
    if dense == "fp8":  # per-row scales over a row-parallel layer's split input would differ per rank
        raise ValueError(f"{where}: quantization=fp8 (per-channel scales) on row-parallel o_proj / down_proj "
                         "would scale each rank's columns on their own; use fp8_block (128-column tiles align "
                         "with the shards) or tensor_parallel_size=1")
    if dense is not None and dense.startswith("fp8_block"):  # 128x128 tiles: each shard must own whole tiles
        T, m = size, cfg.mla
        if cfg.v4 is not None:
            v = cfg.v4
            rows = {"q_b_proj rows per rank": cfg.num_heads // T * v.head_dim,
                    "o_a_proj rows per rank": v.o_groups // T * v.o_lora_rank,
                    "o_b_proj columns per rank": v.o_groups // T * v.o_lora_rank,
                    "shared expert width per rank": cfg.moe_intermediate_size // T}
        elif m is None:
            kvh = cfg.num_kv_heads // T if cfg.num_kv_heads % T == 0 else 1
            rows = {"q rows per rank": cfg.num_heads // T * cfg.head_dim, "k / v rows per rank": kvh * cfg.head_dim,
                    "o_proj columns per rank": cfg.num_heads // T * cfg.head_dim}
        else:
            rows = {"q_b_proj rows per rank": cfg.num_heads // T * m.qk_head_dim,
                    "kv_b_proj rows per rank": cfg.num_heads // T * (m.qk_nope_head_dim + m.v_head_dim),
                    "o_proj columns per rank": cfg.num_heads // T * m.v_head_dim}
        if "intermediate_size" in widths:
            rows["MLP width per rank"] = cfg.intermediate_size // T
        for what, n in rows.items():
            if n % 128:
                raise ValueError(f"{where}: {quantization} needs the {what} ({n}) to be a multiple of 128 (whole "
                                 "tiles per shard, so each shard's scales are the unsharded ones); use a smaller "
                                 "size or quantization=null")
    if "mxfp4" in (quantization or "") and cfg.num_experts and (cfg.moe_intermediate_size // size) % 32:
        raise ValueError(f"{where}: mxfp4 needs each rank's moe_intermediate_size ({cfg.moe_intermediate_size // size}) "
                         "to be a multiple of 32 (whole blocks per shard); use a smaller size")
