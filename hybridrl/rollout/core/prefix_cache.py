"""Retained conversation prefixes: the KV of finished turns that a next turn may continue.

A request finished with ``retain=True`` leaves a copy of its cache row here (the k/v of
every token that was fed through the model: prompt + response minus the last sampled
token), keyed by its request id. A request naming it as ``parent`` gets those slots
copied into its own row and prefills only the rest — its longest common prefix with the
retained tokens, so a continuation that re-tokenized differently is still right.

Budget: ``max_bytes`` of k/v (+ routing record) in total; the least recently used entry
is evicted first. An evicted or stale parent (retained under other weights, after a
refit that recomputes) is a *miss*: the whole prompt is prefilled again, never a wrong
prefix. Ids evicted recently are remembered (bounded), so a parent that was evicted is
told apart from one that never existed (an error).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

FORGET_AFTER = 65536
"""evicted ids remembered for telling 'evicted' from 'unknown'."""


@dataclass
class PrefixEntry:
    tokens: list[int]
    """the tokens whose k/v are held (slot t <-> tokens[t])."""
    kv: tuple[torch.Tensor, ...]
    """``KVCache.read_row`` copies: (k, v) each [num_layers, KVH, len(tokens), D], or (latent,)."""
    routing: torch.Tensor | None
    """MoE routing of those tokens [len(tokens), n_moe_layers, k] or None."""
    weight_version: int
    images: tuple = ()
    """vision-language: ``(start, stop, key)`` of each image among ``tokens`` (prefix reuse
    serves a continuation only up to the first image the two do not share)."""

    @property
    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.kv)
        return n + (self.routing.numel() * self.routing.element_size() if self.routing is not None else 0)


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self.bytes = 0
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self.hits = self.misses = self.evictions = 0
        self.hit_tokens = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.entries

    def was_evicted(self, request_id: str) -> bool:
        return request_id in self._evicted

    def put(self, request_id: str, entry: PrefixEntry) -> None:
        """Keep ``entry`` (replacing one of the same id), then evict LRU entries to the budget;
        an entry larger than the whole budget is not kept (a later child recomputes)."""
        self.drop(request_id)
        if entry.nbytes > self.max_bytes:
            self._forget(request_id)
            return
        self.entries[request_id] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            old_id, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1
            self._forget(old_id)

    def get(self, request_id: str, weight_version: int | None) -> PrefixEntry | None:
        """The entry (now most recently used), or None if missing or retained under another
        version than ``weight_version`` (None: any version)."""
        entry = self.entries.get(request_id)
        if entry is None or (weight_version is not None and entry.weight_version != weight_version):
            self.misses += 1
            return None
        self.entries.move_to_end(request_id)
        self.hits += 1
        return entry

    def drop(self, request_id: str) -> bool:
        entry = self.entries.pop(request_id, None)
        if entry is not None:
            self.bytes -= entry.nbytes
        return entry is not None

    def decline(self, request_id: str) -> None:
        """Not kept (the engine's state cannot be retained): a continuation of it recomputes."""
        self.drop(request_id)
        self._forget(request_id)

    def clear(self) -> None:
        for request_id in list(self.entries):
            self.drop(request_id)
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._evicted[request_id] = None
        while len(self._evicted) > FORGET_AFTER:
            self._evicted.popitem(last=False)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
