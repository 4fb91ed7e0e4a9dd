"""Linear layers with fused inference layouts (``qkv_proj``, ``gate_up_proj``).

A layer only knows its geometry: ``input_size`` and the output sizes of the shards it
packs (``qkv_proj`` = [q, k, v], ``gate_up_proj`` = [gate, up]); storage, loading and the
matmul belong to its *linear method* (``linear_method.py``; FP8 in ``fp8_linear.py``).

Tensor parallelism (``tensor_parallel.py``): a column-parallel layer is built with its
rank's share of output rows and one :class:`TPSlice` per shard (which rows of the HF tensor
it holds); a :class:`RowParallelLinear` holds a share of the input columns and all-reduces
its output. Sizes below are always *this rank's*; ``hf_shape`` is the HF tensor's.

Every layer is built with its ``LayerContext`` (``context.py``): the linear method, dtype,
device, tensor-parallel rank and the layer's module name (``prefix``).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.layers.linear_method import copy_into_slot
from hybridrl.rollout.layers.tensor_parallel import TPSlice


class LinearBase(nn.Module):
    """A linear layer whose output rows are the concatenation of named shards."""

    shard_names: tuple = (None,)

    def __init__(self, input_size: int, output_sizes: list[int], ctx: LayerContext, *, bias: bool,
                 tp_slices: list[TPSlice | None] | None = None, hf_sizes: tuple[int, list[int]] | None = None):
        """``tp_slices``: per shard, the part of its HF tensor this rank holds (None: all);
        ``hf_sizes``: the HF ``(input size, output sizes)`` when they differ from this rank's."""
        super().__init__()
        assert len(output_sizes) == len(self.shard_names)
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.tp_slices = list(tp_slices or [None] * len(output_sizes))
        self.hf_input_size, self.hf_output_sizes = hf_sizes or (input_size, list(output_sizes))
        self.prefix, self.method = ctx.prefix, ctx.linear_method
        self.dtype = ctx.dtype  # the engine's activation dtype, also over FP8 weights (a LoRA adapter's)
        self.adapter = None  # a LoRAAdapter (layers/lora_adapter.py) when the engine applies LoRA here
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size, dtype=ctx.dtype, device=ctx.device),
                                     requires_grad=False)
            self.bias.weight_loader = lambda p, w, shard_id=None: copy_into_slot(self, p, w, shard_id)
        self.method.create_weights(self, ctx.dtype, ctx.device)

    def shard_slice(self, shard_id: str | int | None) -> slice:
        """Rows of the fused output that hold `shard_id`."""
        if shard_id is None:
            assert self.shard_names == (None,), f"{self.prefix}: fused layer needs a shard_id"
            return slice(0, self.output_size)
        idx = self.shard_names.index(shard_id)
        start = sum(self.output_sizes[:idx])
        return slice(start, start + self.output_sizes[idx])

    def shard_shape(self, shard_id: str | int | None, param: str = "weight") -> torch.Size:
        """Shape of this rank's part of the Hugging Face tensor for `shard_id` (before fusion)."""
        rows = self.shard_slice(shard_id)
        n = rows.stop - rows.start
        return torch.Size([n, self.input_size] if param == "weight" else [n])

    def hf_shape(self, shard_id: str | int | None, param: str = "weight") -> torch.Size:
        """Shape of the whole Hugging Face tensor for `shard_id` (what a trainer holds)."""
        n = self.hf_output_sizes[self._shard_index(shard_id)]
        return torch.Size([n, self.hf_input_size] if param == "weight" else [n])

    def tp_slice(self, shard_id: str | int | None, param: str = "weight") -> TPSlice | None:
        """The part of the HF tensor this rank holds (None: all of it)."""
        tp = self.tp_slices[self._shard_index(shard_id)]
        if tp is None or param == "weight" or tp.dim == 0:
            return tp
        return None  # a row-parallel layer's bias is whole (refused under TP: RowParallelLinear)

    def _shard_index(self, shard_id) -> int:
        return 0 if shard_id is None else self.shard_names.index(shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y if self.adapter is None else self.adapter(x, y)


class ReplicatedLinear(LinearBase):
    """Unfused linear, whole on every rank (routers, MLA's down-projections, unsplit layers)."""

    def __init__(self, input_size: int, output_size: int, ctx: LayerContext, *, bias: bool = False):
        super().__init__(input_size, [output_size], ctx, bias=bias)


class ColumnParallelLinear(LinearBase):
    """Unfused linear split over output rows in units of ``unit`` rows (a head's width):
    rank t holds units ``[t·n/T, (t+1)·n/T)`` of the ``output_size / unit`` units."""

    def __init__(self, input_size: int, output_size: int, ctx: LayerContext, *, bias: bool = False, unit: int = 1,
                 what: str = "the output rows"):
        tp = ctx.tp
        start, n = tp.split(output_size // unit, what)
        sl = None if tp.size == 1 else TPSlice(0, ((start * unit, n * unit),))
        super().__init__(input_size, [n * unit], ctx, bias=bias, tp_slices=[sl], hf_sizes=(input_size, [output_size]))


class RowParallelLinear(LinearBase):
    """Linear split over input columns in units of ``unit`` (o_proj over heads, down_proj over
    the MLP width): each rank multiplies its share, one all-reduce sums them. ``reduce=False``
    leaves the partial sum to the caller (the MoE block reduces experts + shared experts once)."""

    def __init__(self, input_size: int, output_size: int, ctx: LayerContext, *, bias: bool = False, unit: int = 1,
                 what: str = "the input columns", reduce: bool = True):
        tp = ctx.tp
        if tp.size > 1 and bias:
            raise ValueError(f"{ctx.prefix or 'a row-parallel linear'}: a bias on a row-parallel projection is "
                             "not supported with tensor_parallel_size > 1 (it would be added once per rank); "
                             "use tensor_parallel_size=1 for this model")
        start, n = tp.split(input_size // unit, what)
        sl = None if tp.size == 1 else TPSlice(1, ((start * unit, n * unit),))
        super().__init__(n * unit, [output_size], ctx, bias=bias, tp_slices=[sl], hf_sizes=(input_size, [output_size]))
        self.tp, self.reduce = tp, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # a LoRA adapter adds its partial product here, before the all-reduce
        return self.tp.all_reduce_(y) if self.reduce else y


class QKVLinear(LinearBase):
    """Fused q/k/v projection: rows [q (H*D) | k (KVH*D) | v (KVH*D)] of this rank's heads."""

    shard_names = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, ctx: LayerContext, *,
                 bias: bool = False):
        D, tp = head_dim, ctx.tp
        h0, h = tp.split(num_heads, "the attention heads")
        k0, kvh = tp.kv_heads(num_kv_heads)
        slices = None
        if tp.size > 1:
            q, kv = TPSlice(0, ((h0 * D, h * D),)), TPSlice(0, ((k0 * D, kvh * D),))
            slices = [q, kv, kv]
        hf = (hidden_size, [num_heads * D, num_kv_heads * D, num_kv_heads * D])
        super().__init__(hidden_size, [h * D, kvh * D, kvh * D], ctx, bias=bias, tp_slices=slices, hf_sizes=hf)


class MergedColumnLinear(LinearBase):
    """Fused gate/up projection: rows [gate (I) | up (I)] (this rank's share of each), shard ids 0 and 1."""

    shard_names = (0, 1)

    def __init__(self, input_size: int, output_sizes: list[int], ctx: LayerContext, *, bias: bool = False):
        tp = ctx.tp
        shares = [tp.split(n, "the MLP intermediate size") for n in output_sizes]
        slices = None if tp.size == 1 else [TPSlice(0, (share,)) for share in shares]
        super().__init__(input_size, [n for _, n in shares], ctx, bias=bias, tp_slices=slices,
                         hf_sizes=(input_size, list(output_sizes)))
