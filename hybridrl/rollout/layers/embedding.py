"""Token embedding and LM head. With tied embeddings the head shares the embedding Parameter.

Tensor parallel (``tensor_parallel.py``): both hold this rank's share of the vocabulary rows
(``ceil(V / T)`` rows, the last share padded); the embedding zeroes the ids outside its share
and all-reduces, the head all-gathers its logits and drops the padding: ``[..., V]`` on
every rank, the same bits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.exact.ops import padded_linear
from hybridrl.rollout.layers import cpu_linear
from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.layers.tensor_parallel import TensorParallel, TPSlice, vocab_share


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


def _vocab_rows(param: nn.Parameter, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
    """Mark a vocabulary-sharded parameter for its route: the HF shape, this rank's slice, and a
    loader that fills its first ``length`` rows (the rest is padding)."""
    start, length, _ = vocab_share(vocab_size, tp)
    param.hf_shape = torch.Size([vocab_size, hidden_size])
    param.tp_slice, param.tp_rows = TPSlice(0, ((start, length),)), slice(0, length)

    def loader(p, loaded, shard_id=None):
        default_weight_loader(p.data[:length], loaded, shard_id)

    param.weight_loader = loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: LayerContext):
        super().__init__()
        self.tp = tp = ctx.tp
        self.vocab_start, self.vocab_len, rows = vocab_share(vocab_size, tp)
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size, dtype=ctx.dtype, device=ctx.device),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if tp.size > 1:
            _vocab_rows(self.weight, vocab_size, hidden_size, tp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_len)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce_(out.masked_fill_(outside.unsqueeze(-1), 0.0))


class LMHead(nn.Module):
    """logits = h @ W.T; `tied_to` makes W the embedding Parameter itself (no copy)."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: LayerContext, tied_to: VocabEmbedding | None = None):
        super().__init__()
        tp = ctx.tp
        self.tied, self.tp, self.vocab_size, self.exact = tied_to is not None, tp, vocab_size, ctx.exact
        if self.tied:
            self.weight = tied_to.weight
        else:
            rows = vocab_share(vocab_size, tp)[2]
            self.weight = nn.Parameter(_head_storage(rows, hidden_size, ctx.dtype, torch.device(ctx.device)),
                                       requires_grad=False)
            self.weight.weight_loader = default_weight_loader
            if tp.size > 1:
                _vocab_rows(self.weight, vocab_size, hidden_size, tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # exact: the trainer's lm_head GEMM, row-tiled (hybridrl.exact); it scores with it the same way
        logits = padded_linear(hidden, self.weight) if self.exact else cpu_linear.linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[..., :self.vocab_size]


# Measured trade-off, kept here so nobody re-derives it: storing the head as a transposed
# view of a contiguous [hidden, V] buffer makes MKL's batch-1 GEMV ~2x faster on this CPU
# (32000 x 512 float32: 2.4 ms vs 5.0 ms; ~16% of a small model's decode step), but every
# refit then writes the largest weight through a transpose (~3 GB/s blocked vs ~10 GB/s),
# which made in-process refit slower than a plain HF load_state_dict. Refit speed is the
# project's promise, so the head stays row-major; set the flag to trade the other way.
TRANSPOSED_HEAD_ON_CPU = False


def _head_storage(vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The [V, hidden] head weight (row-major; see TRANSPOSED_HEAD_ON_CPU). Zeros: a tensor-
    parallel share's padding rows are never loaded (their logits are dropped)."""
    if device.type != "cpu" or not TRANSPOSED_HEAD_ON_CPU:
        return torch.zeros(vocab_size, hidden_size, dtype=dtype, device=device)
    return torch.zeros(hidden_size, vocab_size, dtype=dtype, device=device).t()
