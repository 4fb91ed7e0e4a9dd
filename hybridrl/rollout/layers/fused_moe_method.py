"""How a ``FusedExperts`` layer (``fused_moe.py``) stores its weights and how a trainer
tensor lands in them: the fused-MoE analogue of a linear method (``linear_method.py``).
The base and the unquantized method; MXFP4 is ``mxfp4_moe.py``."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

PROJS = ("gate_up_proj", "down_proj")


class FusedMoEMethodBase(ABC):
    """Storage of a ``FusedExperts`` layer (the fused-MoE analogue of a linear method).

    ``proj`` is ``"gate_up_proj"`` or ``"down_proj"``; ``expert`` None means all experts (the
    fused tensor); ``shard`` 0 / 1 selects the gate / up rows of ``gate_up_proj`` (None: all).
    ``expected_held`` and ``held`` return the same dtype (the engine dtype, or float32 for
    quantized storage) so that refit's exact checksums compare them.
    """

    @abstractmethod
    def create_weights(self, layer: "FusedExperts", dtype: torch.dtype, device: torch.device) -> None: ...

    @abstractmethod
    def loaded_param(self, layer: "FusedExperts", proj: str) -> nn.Parameter:
        """The parameter a trainer tensor for ``proj`` is written into."""

    @abstractmethod
    def weight_loader(self, layer: "FusedExperts", proj: str, loaded: torch.Tensor,
                      expert: int | None, shard: int | None) -> None: ...

    def restore_loading_layout(self, layer: "FusedExperts") -> None:
        """Inference -> loading layout, in place (default: one layout)."""

    def apply_inference_layout(self, layer: "FusedExperts") -> None:
        """Loading -> inference layout, in place (default: one layout)."""

    @abstractmethod
    def expected_held(self, layer: "FusedExperts", proj: str, loaded: torch.Tensor,
                      expert: int | None, shard: int | None) -> torch.Tensor: ...

    @abstractmethod
    def held(self, layer: "FusedExperts", proj: str, expert: int | None, shard: int | None) -> torch.Tensor: ...

    @abstractmethod
    def compute_weights(self, layer: "FusedExperts") -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 ``[E, 2I, H]``, w2 ``[E, H, I]``) in the engine dtype, as the matmuls read them."""


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """``gate_up_proj`` / ``down_proj`` in the engine dtype; loading is a slice ``copy_``."""

    def create_weights(self, layer, dtype, device):
        for proj in PROJS:
            shape = layer.full_shape(proj)
            setattr(layer, proj, nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False))

    def loaded_param(self, layer, proj):
        return getattr(layer, proj)

    def weight_loader(self, layer, proj, loaded, expert, shard):
        slot = layer.slot(getattr(layer, proj).data, proj, expert, shard)
        layer.check_shape(proj, loaded, expert, shard)
        slot.copy_(loaded)

    def expected_held(self, layer, proj, loaded, expert, shard):
        return loaded.to(layer.dtype)

    def held(self, layer, proj, expert, shard):
        return layer.slot(getattr(layer, proj).data, proj, expert, shard)

    def compute_weights(self, layer):
        return layer.gate_up_proj, layer.down_proj
