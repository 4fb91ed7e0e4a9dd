"""Linear layers with fused inference layouts (``qkv_proj``, ``gate_up_proj``).

A layer only knows its geometry: ``input_size`` and the output sizes of the shards it
packs (``qkv_proj`` = [q, k, v], ``gate_up_proj`` = [gate, up]); storage, loading and the
matmul belong to its *linear method* (``linear_method.py``; FP8 in ``fp8_linear.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrl.rollout.layers.linear_method import LinearMethodBase, copy_into_slot


class LinearBase(nn.Module):
    """A linear layer whose output rows are the concatenation of named shards."""

    shard_names: tuple = (None,)

    def __init__(self, input_size: int, output_sizes: list[int], *, bias: bool, method: LinearMethodBase,
                 dtype: torch.dtype, device: torch.device, prefix: str = ""):
        super().__init__()
        assert len(output_sizes) == len(self.shard_names)
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.prefix = prefix
        self.method = method
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size, dtype=dtype, device=device), requires_grad=False)
            self.bias.weight_loader = lambda p, w, shard_id=None: copy_into_slot(self, p, w, shard_id)
        method.create_weights(self, dtype, device)

    def shard_slice(self, shard_id: str | int | None) -> slice:
        """Rows of the fused output that hold `shard_id`."""
        if shard_id is None:
            assert self.shard_names == (None,), f"{self.prefix}: fused layer needs a shard_id"
            return slice(0, self.output_size)
        idx = self.shard_names.index(shard_id)
        start = sum(self.output_sizes[:idx])
        return slice(start, start + self.output_sizes[idx])

    def shard_shape(self, shard_id: str | int | None, param: str = "weight") -> torch.Size:
        """Shape of the Hugging Face tensor for `shard_id` (before fusion)."""
        rows = self.shard_slice(shard_id)
        n = rows.stop - rows.start
        return torch.Size([n, self.input_size] if param == "weight" else [n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class ReplicatedLinear(LinearBase):
    """Unfused linear (o_proj, down_proj)."""

    def __init__(self, input_size: int, output_size: int, **kw):
        super().__init__(input_size, [output_size], **kw)


class QKVLinear(LinearBase):
    """Fused q/k/v projection: rows [q (H*D) | k (KVH*D) | v (KVH*D)]."""

    shard_names = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, **kw):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, **kw)


class MergedColumnLinear(LinearBase):
    """Fused gate/up projection: rows [gate (I) | up (I)], shard ids 0 and 1."""

    shard_names = (0, 1)

    def __init__(self, input_size: int, output_sizes: list[int], **kw):
        super().__init__(input_size, output_sizes, **kw)
