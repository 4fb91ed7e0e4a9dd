"""Masks never cost more memory than their output (DESIGN.md, invariant 2), counted.

Every tensor storage that torch allocates while a builder runs is counted (a dispatch mode
sees each op's outputs; a storage counts from its first appearance until it is freed), so
the peak is the builder's own and the same on every machine: no process RSS, no allocator
thresholds, no page-touching effects. The bound is the invariant's: the output, plus
O(B·S) vectors (at most 16 bytes per position of the ``[B, S]`` padding mask and of one
``[S]`` index), plus the one fixed-size block (``masks._BLOCK_BYTES``) the additive mask
casts through. The naive builder (``ones(S, S)``, ``tril``, casts, ``&``, ``~``) must
exceed the same bound, so the count does see S×S temporaries.
"""

from __future__ import annotations

import random
import weakref

import _seeds
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybridrl.attention import masks

PER_POSITION_BYTES = 16  # two int64 values per position of [B, S] and of [S]: the O(B·S) part


class PeakStorageBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the ``with`` block and still alive."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, weakref.finalize] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._alive.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._alive:  # a new storage (views share their base's)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    self._alive[key] = weakref.finalize(storage, self._freed, key, nbytes)
        return out


def naive(padding_mask: torch.Tensor) -> torch.Tensor:
    """The NPU mask the way that ran out of memory (background/): several S×S temporaries."""
    s = padding_mask.shape[1]
    causal = torch.tril(torch.ones(s, s)).to(torch.bool)
    attend = padding_mask.bool().unsqueeze(-1) & padding_mask.bool().unsqueeze(-2)
    return (~(attend & causal)).unsqueeze(1).contiguous()


def _peak_extra(builder, padding_mask: torch.Tensor) -> tuple[int, int]:
    """(peak bytes beyond the output while building, the bound on them)."""
    with PeakStorageBytes() as count:
        out = builder(padding_mask)
    b, s = padding_mask.shape
    block = masks._BLOCK_BYTES if builder is masks.additive_mask else 0
    return count.peak - out.numel() * out.element_size(), block + PER_POSITION_BYTES * (b * s + s)


def _padding(rng: random.Random) -> torch.Tensor:
    # S >= 2048: an S×S bool temporary (4 MiB and up) exceeds the additive mask's 1 MiB block
    b, s = rng.randint(1, 3), rng.randint(2048, 3072)
    mask = torch.ones(b, s, dtype=torch.long)
    for row in range(b):  # left and right padding
        left, right = rng.randint(0, s // 4), rng.randint(0, s // 4)
        mask[row, :left] = 0
        mask[row, s - right:] = 0
    return mask


@pytest.mark.parametrize("builder", ["npu_fusion_attention_mask", "sdpa_mask", "additive_mask"])
def test_peak_memory_is_the_output(builder):
    seed = _seeds.fresh_seed()
    padding_mask = _padding(random.Random(seed))
    extra, bound = _peak_extra(getattr(masks, builder), padding_mask)
    assert extra <= bound, f"seed {seed}: {builder} {tuple(padding_mask.shape)} allocated {extra} bytes beyond its " \
                           f"output at its peak, bound {bound}"


def test_the_count_sees_square_temporaries():
    seed = _seeds.fresh_seed()
    padding_mask = _padding(random.Random(seed))
    extra, bound = _peak_extra(naive, padding_mask)
    assert extra > bound + masks._BLOCK_BYTES, (seed, tuple(padding_mask.shape), extra, bound)
