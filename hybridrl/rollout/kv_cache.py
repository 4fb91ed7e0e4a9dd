"""Static KV cache: allocated once for (max_batch_size, max_seq_len), reused by every call.

Layout `[num_layers, max_batch_size, num_kv_heads, max_seq_len, head_dim]` for k and v:
row b of a batch lives in cache row b, token t of that row in slot t. Attention reads
`k[layer, :B, :, :T]` as a view ([B, KVH, T, D], what SDPA wants) without copying.
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

    def move_rows(self, src_rows: torch.Tensor, length: int) -> None:
        """Compaction: row i <- old row src_rows[i] (slots [0, length)), in place.

        The gather makes a transient copy of the surviving rows; the cache tensors
        themselves never move.
        """
        n = src_rows.numel()
        self.k[:, :n, :, :length] = self.k[:, src_rows, :, :length]
        self.v[:, :n, :, :length] = self.v[:, src_rows, :, :length]

    def named_tensors(self):
        yield "kv_cache.k", self.k
        yield "kv_cache.v", self.v
