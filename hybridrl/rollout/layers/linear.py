"""Linear layers with fused inference layouts, delegating storage and matmul to a
*linear method* (vLLM's `quant_method` idea).

A layer only knows its geometry: `input_size` and the output sizes of the shards it
packs (`qkv_proj` = [q, k, v], `gate_up_proj` = [gate, up]). The linear method owns
everything about the weight:

    create_weights(layer, dtype, device)
        Register `layer.weight` (and any extra tensors: scales, a dequantized derived
        cache) as Parameters/buffers on `layer`, each allocated once. Every tensor the
        method keeps must be registered so `RolloutEngine.named_state_tensors` sees it.
        Give each Parameter a `weight_loader(param, loaded_weight, shard_id=None)`.
    weight_loader(layer, param, loaded_weight, shard_id)
        Write one full-precision Hugging Face tensor in place into its slot of the
        fused weight: rows `layer.shard_slice(shard_id)` (shard_id "q"/"k"/"v",
        0/1 for gate/up, None for an unfused layer). Never rebind `param`.
    process_weights_after_loading(layer)
        Called once after every load/refit; refreshes derived caches in place.
    apply(layer, x) -> y
        x [..., input_size] -> y [..., output_size] (bias included).

Biases are never quantized; the layer loads them itself with the same shard slices.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch
from torch import nn

from hybridrl.rollout.layers import cpu_linear


class LinearMethodBase(ABC):
    """The interface in the module docstring; subclasses implement the abstract methods."""

    @abstractmethod
    def create_weights(self, layer: "LinearBase", dtype: torch.dtype, device: torch.device) -> None: ...

    @abstractmethod
    def weight_loader(self, layer: "LinearBase", param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: str | int | None = None) -> None: ...

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        pass

    @abstractmethod
    def apply(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor: ...


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain `[out, in]` weight in the engine dtype; y = x @ W.T + b."""

    def create_weights(self, layer, dtype, device):
        weight = torch.empty(layer.output_size, layer.input_size, dtype=dtype, device=device)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight.weight_loader = lambda p, w, shard_id=None: self.weight_loader(layer, p, w, shard_id)

    def weight_loader(self, layer, param, loaded_weight, shard_id=None):
        copy_into_slot(layer, param, loaded_weight, shard_id)

    def apply(self, layer, x):
        return cpu_linear.linear(x, layer.weight, layer.bias)


def copy_into_slot(layer: "LinearBase", param: torch.Tensor, loaded: torch.Tensor,
                   shard_id: str | int | None) -> None:
    """In-place copy of one HF tensor into rows `layer.shard_slice(shard_id)` of `param`."""
    rows = layer.shard_slice(shard_id)
    slot = param.data[rows]
    if tuple(loaded.shape) != tuple(slot.shape):
        raise ValueError(
            f"weight for {layer.prefix} shard {shard_id!r} has shape {tuple(loaded.shape)}, "
            f"expected {tuple(slot.shape)}; check that the checkpoint matches the engine config"
        )
    slot.copy_(loaded)


def get_linear_method(quantization: str | None) -> LinearMethodBase:
    """None -> UnquantizedLinearMethod; "fp8" / "fp8_block" -> Fp8LinearMethod (lazy)."""
    if quantization is None:
        return UnquantizedLinearMethod()
    if quantization not in ("fp8", "fp8_block"):
        raise ValueError(f"quantization={quantization!r} is not supported; use None, 'fp8' or 'fp8_block'")
    try:
        module = importlib.import_module("hybridrl.rollout.layers.fp8_linear")
    except ModuleNotFoundError as e:
        if e.name != "hybridrl.rollout.layers.fp8_linear":
            raise
        raise ValueError(
            f"quantization={quantization!r} needs hybridrl/rollout/layers/fp8_linear.py, which is "
            f"not available in this build; use quantization=None"
        ) from None
    return module.Fp8LinearMethod(block=quantization == "fp8_block")


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
