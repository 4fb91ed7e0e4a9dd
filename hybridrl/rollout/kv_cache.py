"""Static slot KV cache: allocated once for (max_batch_size, max_seq_len), reused by every call.

Layout `[num_layers, max_batch_size, num_kv_heads, max_seq_len, head_dim]` for k and v:
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

from hybridrl.rollout.model_config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device):
        shape = (cfg.num_layers, max_batch_size, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        # zeros, not empty: a padded CUDA-graph row may read slots nobody wrote; keep them finite.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len

    @property
    def bytes_per_token(self) -> int:
        """k + v bytes of one token of one row (all layers)."""
        L, _, KVH, _, D = self.k.shape
        return 2 * L * KVH * D * self.k.element_size()

    def copy_rows(self, dst_rows: torch.Tensor, src_rows: torch.Tensor, length: int) -> None:
        """Row dst_rows[i] <- row src_rows[i] (slots [0, length)), in place.

        The gather makes a transient copy of the source rows first, so sources and
        destinations may overlap; the cache tensors themselves never move.
        """
        self.k[:, dst_rows, :, :length] = self.k[:, src_rows, :, :length]
        self.v[:, dst_rows, :, :length] = self.v[:, src_rows, :, :length]

    def read_row(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of row ``row``'s slots [0, length): k, v ``[num_layers, KVH, length, D]``."""
        return self.k[:, row, :, :length].clone(), self.v[:, row, :, :length].clone()

    def write_row(self, row: int, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        """Slots [0, length) of row ``row`` <- the first ``length`` slots of ``read_row`` copies."""
        self.k[:, row, :, :length].copy_(k[:, :, :length])
        self.v[:, row, :, :length].copy_(v[:, :, :length])

    def named_tensors(self):
        yield "kv_cache.k", self.k
        yield "kv_cache.v", self.v
