"""RMSNorm with an optional fused residual add (the common pre-norm decoder pattern)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.exact.ops import pieced_unary


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) over the last dim; computed in float32 like HF."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device, exact: bool = False):
        """``exact``: transformers' formula op for op, ``rsqrt`` on the SIMD path (``hybridrl.exact``)."""
        super().__init__()
        self.eps, self.exact = eps, exact
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = copy_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:  # Qwen2RMSNorm / LlamaRMSNorm.forward, as the trainer runs it under the exact mode
            h = x.to(torch.float32)
            h = h * pieced_unary(torch.rsqrt, h.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * h.to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # HF: normalize in float32, cast back, then scale by the weight in the model dtype.
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return self.weight * y

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        residual = x + residual
        return self.forward(residual), residual


def copy_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """The loader of an unfused, unquantized parameter (norms, routers): a checked in-place copy."""
    assert shard_id is None
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"weight has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}; "
                         f"check that the checkpoint matches the engine config")
    param.data.copy_(loaded)
