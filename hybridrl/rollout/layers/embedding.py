"""Token embedding and LM head. With tied embeddings the head shares the embedding Parameter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.rollout.layers import cpu_linear


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Whole-tensor in-place copy with a shape check."""
    assert shard_id is None
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"weight has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}; "
                         f"check that the checkpoint matches the engine config (vocab_size, hidden_size)")
    copy_into_(param.data, loaded)


# Rows per block when writing into a transposed (column-major) destination: a plain
# copy_ through the transposed view runs at ~0.85 GB/s here (cache-hostile strides);
# 256-row blocks keep each source block and its destination columns in cache: ~3 GB/s.
TRANSPOSED_COPY_BLOCK_ROWS = 256


def copy_into_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` in place; blocked when ``dst`` is a transposed 2-D view."""
    if dst.dim() == 2 and not dst.is_contiguous() and dst.t().is_contiguous() and dst.device.type == "cpu":
        for i in range(0, dst.shape[0], TRANSPOSED_COPY_BLOCK_ROWS):
            dst[i:i + TRANSPOSED_COPY_BLOCK_ROWS].copy_(src[i:i + TRANSPOSED_COPY_BLOCK_ROWS])
        return
    dst.copy_(src)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """logits = h @ W.T; `tied_to` makes W the embedding Parameter itself (no copy)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 tied_to: VocabEmbedding | None = None):
        super().__init__()
        self.tied = tied_to is not None
        if self.tied:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(_head_storage(vocab_size, hidden_size, dtype, torch.device(device)),
                                       requires_grad=False)
            self.weight.weight_loader = default_weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(hidden, self.weight)


# Measured trade-off, kept here so nobody re-derives it: storing the head as a transposed
# view of a contiguous [hidden, V] buffer makes MKL's batch-1 GEMV ~2x faster on this CPU
# (32000 x 512 float32: 2.4 ms vs 5.0 ms; ~16% of a small model's decode step), but every
# refit then writes the largest weight through a transpose (~3 GB/s blocked vs ~10 GB/s),
# which made in-process refit slower than a plain HF load_state_dict. Refit speed is the
# project's promise, so the head stays row-major; set the flag to trade the other way.
TRANSPOSED_HEAD_ON_CPU = False


def _head_storage(vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The [V, hidden] head weight (row-major; see TRANSPOSED_HEAD_ON_CPU)."""
    if device.type != "cpu" or not TRANSPOSED_HEAD_ON_CPU:
        return torch.empty(vocab_size, hidden_size, dtype=dtype, device=device)
    return torch.empty(hidden_size, vocab_size, dtype=dtype, device=device).t()
