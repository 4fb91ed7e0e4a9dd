"""Linear methods: what a linear layer stores and how it multiplies (vLLM's ``quant_method``).

A ``LinearBase`` layer only knows its geometry (``input_size``, the output sizes of the
shards it packs). Its method owns the weight:

    create_weights(layer, dtype, device)
        Register ``layer.weight`` (and any extra tensors: scales, a dequantized derived
        cache) on ``layer``, each allocated once. Every tensor the method keeps must be
        registered so ``RolloutEngine.named_state_tensors`` sees it. Give each Parameter a
        ``weight_loader(param, loaded_weight, shard_id=None)``.
    weight_loader(layer, param, loaded_weight, shard_id)
        Write one full-precision Hugging Face tensor in place into its slot of the fused
        weight: rows ``layer.shard_slice(shard_id)``. Never rebind ``param``. Only called
        inside the engine's weight update (layers are then in loading layout).
    restore_loading_layout(layer) / apply_inference_layout(layer)
        In-place layout switches run by the engine's weight-update bracket (begin / finish);
        no-ops for layouts that need none. Each must be a no-op when already in that layout.
        ``in_inference_layout(layer)`` says which one the layer is in (derived caches of other
        modules computed from it, e.g. MLA's absorbed matrices, refuse to refresh otherwise).
    expected_held(layer, loaded_weight, shard_id) -> Tensor [rows, K]
        The values the layer will hold for that shard once ``weight_loader`` wrote
        ``loaded_weight``, computed independently of the layer's storage, on
        ``loaded_weight``'s device, the way the loader computes them (for refit verification).
    held(layer, rows) -> Tensor [rows, K]
        The values the layer holds now for weight rows ``rows``, in either layout.
    apply(layer, x) -> y
        x [..., input_size] -> y [..., output_size] (bias included).

``expected_held`` and ``held`` return the same dtype (one that represents the values
exactly: the engine dtype, or float32 for FP8), so a checksum of one equals a checksum of
the other exactly when the write landed where it should. Biases are never quantized; the
layer loads them itself with the same shard slices.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from hybridrl.rollout.layers import cpu_linear

# ``layer`` below is always the ``LinearBase`` that owns the method; it is typed
# ``nn.Module`` because linear.py imports this module (naming its class here would be a cycle).


class LinearMethodBase(ABC):
    """The interface in the module docstring; subclasses implement the abstract methods."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, dtype: torch.dtype, device: torch.device) -> None: ...

    @abstractmethod
    def weight_loader(self, layer: nn.Module, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: str | int | None = None) -> None: ...

    def restore_loading_layout(self, layer: nn.Module) -> None:
        """Inference -> loading layout, in place (default: the two layouts are one)."""

    def apply_inference_layout(self, layer: nn.Module) -> None:
        """Loading -> inference layout, in place (default: the two layouts are one)."""

    def in_inference_layout(self, layer: nn.Module) -> bool:
        """Whether ``layer`` is in inference layout now (a derived cache computed from it is
        only valid then; default: the two layouts are one, so always)."""
        return True

    @abstractmethod
    def expected_held(self, layer: nn.Module, loaded_weight: torch.Tensor,
                      shard_id: str | int | None) -> torch.Tensor: ...

    @abstractmethod
    def held(self, layer: nn.Module, rows: slice) -> torch.Tensor: ...

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor: ...


class UnquantizedLinearMethod(LinearMethodBase):
    """Plain ``[out, in]`` weight in the engine dtype; y = x @ W.T + b."""

    def create_weights(self, layer, dtype, device):
        weight = torch.empty(layer.output_size, layer.input_size, dtype=dtype, device=device)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight.weight_loader = lambda p, w, shard_id=None: self.weight_loader(layer, p, w, shard_id)

    def weight_loader(self, layer, param, loaded_weight, shard_id=None):
        copy_into_slot(layer, param, loaded_weight, shard_id)

    def expected_held(self, layer, loaded_weight, shard_id):
        """``loaded_weight`` cast to the engine dtype: what ``copy_`` writes."""
        return loaded_weight.to(layer.weight.dtype)

    def held(self, layer, rows):
        return layer.weight.data[rows]

    def apply(self, layer, x):
        return cpu_linear.linear(x, layer.weight, layer.bias)


def copy_into_slot(layer: nn.Module, param: torch.Tensor, loaded: torch.Tensor,
                   shard_id: str | int | None) -> None:
    """In-place copy of one HF tensor into rows ``layer.shard_slice(shard_id)`` of ``param``."""
    rows = layer.shard_slice(shard_id)
    slot = param.data[rows]
    if tuple(loaded.shape) != tuple(slot.shape):
        raise ValueError(
            f"weight for {layer.prefix} shard {shard_id!r} has shape {tuple(loaded.shape)}, "
            f"expected {tuple(slot.shape)}; check that the checkpoint matches the engine config"
        )
    slot.copy_(loaded)

