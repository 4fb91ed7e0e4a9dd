"""Static slot KV cache: allocated once for (max_batch_size, max_seq_len), reused by every call.

Layout `[num_layers, max_batch_size, num_kv_heads, max_seq_len, head_dim]` for k and v
(multi-head latent attention: one ``latent`` tensor with one "head", see ``KVCache``):
a running request owns one cache *row* (its slot) for its whole life, token t of it in
slot t. The scheduler keeps the running rows packed at [0, n) (a finished row's hole is
filled by moving the last row into it, ``copy_rows``), so attention reads
`k[layer, :n, :, :T]` as a view ([n, KVH, T, D], what SDPA wants) without copying.

A row holds a whole max_seq_len sequence, so a request admitted to a row can always run
to its end: memory is reserved at admission, never short mid-generation (admission
control is the number of free rows; see scheduler.py).
"""

from __future__ import annotations

import torch

from hybridrl.rollout.layers.tensor_parallel import TensorParallel
from hybridrl.rollout.model_config import ModelConfig


def cache_shapes(cfg: ModelConfig, max_batch_size: int, max_seq_len: int,
                 kv_heads: int | None = None) -> list[tuple[int, ...]]:
    """The shape of each ``KVCache`` tensor, ``[num_layers, rows, heads, slots, width]`` (what
    ``rollout/core/memory.py`` counts before anything is allocated)."""
    return [(cfg.num_layers, max_batch_size, kv_heads if (kv_heads and name in ("k", "v")) else heads,
             max_seq_len, width) for name, heads, width in cfg.kv_layout]


def rank_kv_heads(cfg: ModelConfig, tp: TensorParallel) -> int | None:
    """The KV heads this rank's cache holds under tensor parallelism (None: all of them;
    MLA's latent is whole on every rank)."""
    return None if cfg.mla is not None or tp.size == 1 else tp.kv_heads(cfg.num_kv_heads)[1]


class KVCache:
    """One tensor per entry of ``cfg.kv_layout``, each ``[num_layers, rows, heads, slots, width]``:
    ``k`` and ``v`` for GQA attention; ``latent`` for multi-head latent attention (one "head"
    of ``kv_lora_rank + qk_rope_head_dim``: the compressed KV every query head reads)."""

    def __init__(self, cfg: ModelConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device, kv_heads: int | None = None):
        """``kv_heads``: the KV heads this rank holds under tensor parallelism (default: all)."""
        self.names = tuple(name for name, _, _ in cfg.kv_layout)
        # zeros, not empty: a padded CUDA-graph row may read slots nobody wrote; keep them finite.
        self.tensors = tuple(torch.zeros(shape, dtype=dtype, device=device)
                             for shape in cache_shapes(cfg, max_batch_size, max_seq_len, kv_heads))
        for name, t in zip(self.names, self.tensors):
            setattr(self, name, t)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one row takes in the cache (all layers, every tensor)."""
        return sum(t.shape[0] * t.shape[2] * t.shape[4] * t.element_size() for t in self.tensors)

    def copy_rows(self, dst_rows: torch.Tensor, src_rows: torch.Tensor, length: int) -> None:
        """Row dst_rows[i] <- row src_rows[i] (slots [0, length)), in place.

        The gather makes a transient copy of the source rows first, so sources and
        destinations may overlap; the cache tensors themselves never move.
        """
        for t in self.tensors:
            t[:, dst_rows, :, :length] = t[:, src_rows, :, :length]

    def read_row(self, row: int, length: int) -> tuple[torch.Tensor, ...]:
        """Copies of row ``row``'s slots [0, length), one per cache tensor: ``[num_layers, heads, length, width]``."""
        return tuple(t[:, row, :, :length].clone() for t in self.tensors)

    def write_row(self, row: int, saved: tuple[torch.Tensor, ...], length: int) -> None:
        """Slots [0, length) of row ``row`` <- the first ``length`` slots of ``read_row`` copies."""
        for t, s in zip(self.tensors, saved):
            t[:, row, :, :length].copy_(s[:, :, :length])

    def named_tensors(self):
        for name, t in zip(self.names, self.tensors):
            yield f"kv_cache.{name}", t
