"""Derived caches: tensors the engine computes from its weights, refreshed in place.

A derived cache (a dequantized copy of an FP8 weight, a re-laid-out or tied weight) is
read by the forward pass — and by any CUDA graph captured over it, which holds its raw
address. The two ways refit has gone wrong in real frameworks:

1. *Delete and lazily rebuild*: the rebuild allocates new storage; a captured graph
   still reads the old, freed address. Silent wrong rollouts in graph mode.
2. *Refresh too early*: recomputing the cache before the quantized weights are back in
   their inference layout reads staging data.

So a ``DerivedCache`` owns one preallocated tensor for the engine's lifetime (registered
as a non-persistent buffer on its module, so the engine's address snapshot sees it), and
``refresh()`` recomputes it **into that tensor**. It refuses to run unless its sources
say they are ready (``ready()``: e.g. "every source layer is in inference layout"), so
refreshing before restoring is impossible through the API, not merely discouraged.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch


class DerivedCacheError(ValueError):
    """A derived cache was refreshed out of order or lost its storage."""


class DerivedCache:
    """One preallocated tensor recomputed in place from its sources.

    Args:
        module: owner; the tensor is registered on it as non-persistent buffer ``attr``.
        attr: buffer name (e.g. ``"weight_dequant"``).
        tensor: the preallocated storage, any shape/dtype; never replaced.
        compute: ``compute(out)`` writes the fresh value into ``out`` (in place).
        ready: ``ready() -> bool``, True when the sources are in the layout ``compute``
            reads (for FP8: inference layout). ``refresh`` raises otherwise.
    """

    def __init__(self, module: torch.nn.Module, attr: str, tensor: torch.Tensor,
                 compute: Callable[[torch.Tensor], None],
                 ready: Callable[[], bool] = lambda: True):
        module.register_buffer(attr, tensor, persistent=False)
        self.module, self.attr = module, attr
        self.compute, self.ready = compute, ready
        self.data_ptr = tensor.data_ptr()
        registry = module.__dict__.setdefault("_derived_caches", {})
        registry[attr] = self

    @property
    def tensor(self) -> torch.Tensor:
        """The live buffer (looked up on the module so a rebinding is detectable)."""
        return getattr(self.module, self.attr)

    def refresh(self) -> None:
        """Recompute into the existing storage; raises if sources are not ready."""
        if not self.ready():
            raise DerivedCacheError(
                f"derived cache {self.attr!r} refreshed while its sources are not in "
                "inference layout; refresh only through the engine's finish_weight_update()")
        out = self.tensor
        if out.data_ptr() != self.data_ptr:
            raise DerivedCacheError(
                f"derived cache {self.attr!r} was rebound to new storage; write into the "
                "registered tensor instead (a captured graph holds the old address)")
        with torch.no_grad():
            self.compute(out)

    def expected(self) -> torch.Tensor:
        """A fresh out-of-place computation, to check the cache is current (allocates)."""
        out = torch.empty_like(self.tensor)
        with torch.no_grad():
            self.compute(out)
        return out


def named_derived_caches(model: torch.nn.Module) -> Iterator[tuple[str, DerivedCache]]:
    """Every registered ``DerivedCache`` in ``model``, as ``(module_path.attr, cache)``."""
    for mod_name, module in model.named_modules():
        for attr, cache in module.__dict__.get("_derived_caches", {}).items():
            yield (f"{mod_name}.{attr}" if mod_name else attr), cache
