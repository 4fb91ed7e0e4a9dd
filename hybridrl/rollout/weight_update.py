"""The engine's weight-update bracket: ``begin`` -> ``load``* -> ``finish`` (or ``abort``).

Every write of trainer weights into the engine — the first load, every refit, a
checkpoint — runs through this one bracket, because the order is where refit has gone
wrong in real frameworks:

- ``begin``  puts every linear back into its *loading* layout, in place (a layout step
             such as ROCm's e4m3fnuz scale doubling, re-applied without being undone,
             doubles the scale on every sync);
- ``load``   writes tensors through the route table's loaders, in place;
- ``finish`` (1) re-applies the *inference* layout to **every** linear, then (2) refreshes
             **every** registered derived cache in place (a cache refreshed before (1)
             would be computed from staging data), then (3) requires that every expected
             name was written and runs the caller's ``check``. Only when all of that
             passed does the engine commit (advance ``weight_version``; see engine.py).
- ``abort``  runs (1) and (2) and commits nothing.

Steps (1) and (2) are private and run only in that order; each ``DerivedCache.refresh``
also refuses to run while its layer is in loading layout. Calls out of order raise
``WeightUpdateError``. This object holds no tensors of its own: it never allocates
engine storage, so every address a captured CUDA graph holds survives an update.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from hybridrl.rollout.backend import listing
from hybridrl.rollout.derived import named_derived_caches
from hybridrl.rollout.layers.fused_moe import FusedExperts
from hybridrl.rollout.layers.linear import LinearBase
from hybridrl.rollout.weight_routes import WeightRoutes


class WeightUpdateError(ValueError):
    """A weight update was used out of order or ended incomplete."""


class WeightUpdate:
    """The bracket's state for one engine (reused for every update of that engine)."""

    def __init__(self, model: nn.Module, routes: WeightRoutes):
        self.model, self.routes = model, routes
        # every layer whose method owns a loading/inference layout: linears and fused experts
        self.linears = [m for m in model.modules() if isinstance(m, (LinearBase, FusedExperts))]
        self.is_open = False
        self.written: set[str] = set()
        self.required: frozenset[str] | None = None  # a partial update's names; None = every expected name

    def begin(self, required: Iterable[str] | None = None) -> None:
        """``required``: a *partial* update (LoRA: the adapters, or the merged targeted
        weights) that must write exactly these names; the other weights keep their values."""
        if self.is_open:
            raise WeightUpdateError("a weight update of this engine is already in progress; "
                                    "finish or abort it first")
        self.is_open, self.written = True, set()
        self.required = None if required is None else frozenset(required)
        try:
            for layer in self.linears:
                layer.method.restore_loading_layout(layer)
        except BaseException:
            self.abort()
            raise

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Write each ``(hf_name, tensor)`` in place; returns the names written (ignored ones skipped)."""
        self._expect_open("load")
        loaded: set[str] = set()
        with torch.no_grad():
            for hf_name, tensor in named_tensors:
                if hf_name in self.routes.ignored:
                    continue
                route = self.routes[hf_name]
                try:
                    route.load(tensor.detach())
                except ValueError as e:
                    raise ValueError(f"loading {hf_name!r}: {e}") from None
                loaded.add(hf_name)
        self.written |= loaded
        return loaded

    def finish(self, check: Callable[[], None] | None = None) -> None:
        """Layouts, then caches, then completeness and ``check()``; raises if any fails.

        The bracket is closed whatever happens; the caller commits only if this returns.
        """
        self._expect_open("finish")
        self._close()
        missing = (self.routes.missing(self.written) if self.required is None  # may arrive as its aliases
                   else self.required - self.written)
        if missing:
            raise WeightUpdateError(f"weight update incomplete: {len(missing)} weights never loaded: "
                                    f"{listing(missing)}; weight_version was not advanced; "
                                    "load every name of engine.expected_weight_names() (or, in a partial "
                                    "update, every name it announced)")
        if check is not None:
            check()

    def abort(self) -> None:
        """Back to inference layout with fresh caches; commits nothing. No-op when closed."""
        if self.is_open:
            self._close()

    def _close(self) -> None:
        self.is_open = False
        # (1) every quantized weight back to inference layout, THEN (2) every derived cache.
        with torch.no_grad():
            for layer in self.linears:
                layer.method.apply_inference_layout(layer)
            for _, cache in named_derived_caches(self.model):
                cache.refresh()

    def _expect_open(self, step: str) -> None:
        if not self.is_open:
            raise WeightUpdateError(f"{step}: no weight update in progress; call "
                                    "engine.begin_weight_update() first")
