"""Per-request attention state of DeepSeek-V4 in the engine (the KV cache of its layers).

One row per running request, allocated once for ``max_batch_size`` rows. Per layer, by type:

- every layer: ``swa [rows, W, D]``, a ring of the last ``sliding_window`` rotated K=V
  vectors, position p in slot ``p % W``;
- compressed layers (CSA rate m, HCA rate M): ``comp [rows, max_seq_len // rate + 1, D]``,
  entry w of the window ``[w * rate, (w + 1) * rate)`` (valid once complete), and the raw
  compressor projections of the last ``2m`` (CSA, overlapping windows) or ``M`` (HCA)
  tokens — ``raw_kv`` / ``raw_gate`` rings, position p in slot ``p % ring`` — from which a
  decode step rebuilds the entry of the window it is in;
- CSA layers also the lightning indexer's ``index`` keys and its own raw rings.

The state is a function of the token prefix and the weights (rebuilt by a prefill, which
``kv_on_refit=recompute`` runs with the new weights). It cannot be rewound to a shorter
prefix (the rings forget), so a finished request's state is not retained for a continued
conversation (``retainable = False``: the continuation is prefilled from scratch).
Bytes per token: ``bytes_per_token`` counts what grows with context (entries); the rings are
a constant per row (``row_constant_bytes``).
"""
from __future__ import annotations

import torch

from hybridrl.rollout.models.deepseek_v4.config import V4Dims


class V4StateCache:
    retainable = False

    def __init__(self, dims: V4Dims, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device):
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.layers: list[dict[str, torch.Tensor]] = [
            {name: torch.zeros((max_batch_size, *shape), dtype=dtype, device=device) for name, shape in row.items()}
            for row in state_shapes(dims, max_seq_len)]
        self.dims = dims

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token of context that grow with it (the compressed entries), all layers."""
        total = 0.0
        for kind, state in zip(self.dims.layer_types, self.layers):
            for name in ("comp", "index"):
                if name in state:
                    t = state[name]
                    rate = self.dims.hca_rate if kind == "heavily_compressed_attention" else self.dims.csa_rate
                    total += t.shape[-1] * t.element_size() / rate
        return int(round(total))

    @property
    def row_constant_bytes(self) -> int:
        """Bytes of one row's rings (sliding window and compressor rings): constant in context."""
        return sum(t[0].numel() * t.element_size() for state in self.layers for n, t in state.items()
                   if n not in ("comp", "index"))

    def bytes_at(self, context: int) -> int:
        """One row's state bytes at ``context`` tokens (rings + the entries that context fills)."""
        return self.row_constant_bytes + self.bytes_per_token * context

    def copy_rows(self, dst_rows: torch.Tensor, src_rows: torch.Tensor, length: int) -> None:
        """Row dst_rows[i] <- row src_rows[i], every tensor whole (rings have no length axis)."""
        for state in self.layers:
            for t in state.values():
                t[dst_rows] = t[src_rows]

    def read_row(self, row: int, length: int):
        raise RuntimeError("V4StateCache rows are not retained (the state cannot be rewound); "
                           "the scheduler checks retainable first")

    def named_tensors(self):
        for i, state in enumerate(self.layers):
            for name, t in state.items():
                yield f"kv_cache.layers.{i}.{name}", t


def state_shapes(dims: V4Dims, max_seq_len: int) -> list[dict[str, tuple[int, ...]]]:
    """Per layer, the shape of one row of each state tensor (the cache holds ``max_batch_size``
    rows of each; what ``rollout/core/memory.py`` counts before anything is allocated)."""
    D, DI, W = dims.head_dim, dims.index_head_dim, dims.sliding_window
    shapes = []
    for kind in dims.layer_types:
        row = {"swa": (W, D)}
        if kind == "heavily_compressed_attention":
            M = dims.hca_rate
            row.update(comp=(max_seq_len // M + 1, D), raw_kv=(M, D), raw_gate=(M, D))
        elif kind == "compressed_sparse_attention":
            m = dims.csa_rate
            row.update(comp=(max_seq_len // m + 1, D), raw_kv=(2 * m, 2 * D), raw_gate=(2 * m, 2 * D),
                       index=(max_seq_len // m + 1, DI), index_raw_kv=(2 * m, 2 * DI), index_raw_gate=(2 * m, 2 * DI))
        shapes.append(row)
    return shapes


def ring_positions(last: torch.Tensor, size: int) -> torch.Tensor:
    """For rows whose newest position is ``last [B]``: the position each ring slot holds,
    ``[B, size]`` (slot s holds the newest p <= last with p % size == s; negative = empty)."""
    s = torch.arange(size, device=last.device).view(1, size)
    return last.view(-1, 1) - torch.remainder(last.view(-1, 1) - s, size)
