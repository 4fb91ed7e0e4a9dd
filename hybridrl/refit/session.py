"""The refit protocol: ``begin()`` → ``load(bucket)``* → ``finish()``, as a state machine.

Why the order is enforced here and not documented in a comment: the real bugs were
order bugs. A derived cache refreshed before the quantized weights were back in their
inference layout was computed from staging data; a cache dropped and lazily rebuilt
after refit moved to a new address under a captured CUDA graph. So:

- ``begin()``   puts every quantized linear back into its *loading* layout (in place);
- ``load()``    validates a whole bucket, then writes it through the parameters' own
                ``weight_loader``s (the first-load path, run again) — in place;
- ``finish()``  (1) re-applies the *inference* layout to **every** linear, then
                (2) refreshes **every** registered derived cache, in place; then checks
                (``verify=True``) and advances ``engine.weight_version``.

Steps (1) and (2) are private and only ``finish()`` calls them, in that order; and each
``DerivedCache.refresh`` itself refuses to run while its layer is in loading layout, so
refreshing before restoring cannot be expressed through the API. Any other call order
raises ``RefitError``.
"""
from __future__ import annotations

import enum
import time
import weakref
from dataclasses import dataclass
from typing import Iterable

import torch

from hybridrl.refit import verify as V
from hybridrl.refit.bucket import nbytes
from hybridrl.refit.errors import RefitError, listing
from hybridrl.refit.layout import NameLayout
from hybridrl.rollout.derived import named_derived_caches
from hybridrl.rollout.layers.linear import LinearBase
from hybridrl.quant.fp8 import (FP8_DTYPE, abs_error_bound, block_scale_shape, dequantize_,
                                quantize_)

_ACTIVE: "weakref.WeakKeyDictionary[object, Refit]" = weakref.WeakKeyDictionary()


class State(enum.Enum):
    NEW = "new"
    LOADING = "loading"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class RefitStats:
    bytes_moved: int  # bytes of trainer tensors received
    seconds: float  # begin() to the end of finish()
    version: int  # engine.weight_version after this refit
    num_tensors: int

    @property
    def gbps(self) -> float:
        return self.bytes_moved / max(self.seconds, 1e-12) / 1e9


def _layout_of(engine) -> NameLayout:
    """The engine's name layout, built once per engine (it depends only on the engine's
    fixed parameters, whose addresses never change)."""
    layout = getattr(engine, "_refit_name_layout", None)
    if layout is None:
        layout = NameLayout(engine)
        engine._refit_name_layout = layout
    return layout


class Refit:
    """One refit of ``engine``. Use ``refit_session(engine)`` or call the steps yourself."""

    def __init__(self, engine, *, verify: bool = False):
        self.engine, self.verify = engine, verify
        self.state = State.NEW
        self.layout = _layout_of(engine)
        self.written: set[str] = set()
        self.bytes = 0
        self._sent: dict[str, tuple[float, float]] = {}
        self._addresses: dict[str, V.TensorRecord] = {}
        self._t0 = 0.0

    # -- protocol ---------------------------------------------------------------------
    def begin(self, names: Iterable[str] | None = None) -> "Refit":
        """Announce the names to be sent (default: all) and enter loading layout."""
        self._expect(State.NEW, "begin")
        if _ACTIVE.get(self.engine) is not None:
            raise RefitError("another refit of this engine is in progress; finish() or abort it first")
        self.layout.check_announced(self.layout.expected if names is None else names)
        self._t0 = time.perf_counter()
        if self.verify:
            self._addresses = V.snapshot(self.engine.named_state_tensors())
        _ACTIVE[self.engine] = self
        self.state = State.LOADING
        try:
            for layer in self._linears():
                restore = getattr(layer.method, "restore_loading_layout", None)
                if restore is not None:
                    restore(layer)
        except BaseException:
            self.abort()  # re-applies inference layouts and releases the engine
            raise
        return self

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Validate one bucket as a whole, then write it in place."""
        self._expect(State.LOADING, "load")
        named = [(n, t.detach()) for n, t in named_tensors]
        try:
            routes = self.layout.check_bucket(named, self.written)
        except RefitError as e:
            self.abort()
            if self.written:
                raise RefitError(f"{e} (but {len(self.written)} earlier tensors of this refit were "
                                 "written: the engine holds a partial refit; run a complete one)") from None
            raise
        by_name = {r.hf_name: r for r in routes}
        with torch.no_grad():
            for name, t in named:
                r = by_name.get(name)
                if r is None:
                    continue  # tied lm_head
                if self.verify:
                    self._sent[name] = self._sent_checksum(r, t)
                r.write(t)
                self.written.add(name)
                self.bytes += nbytes(t)

    def finish(self) -> RefitStats:
        """Inference layouts, then derived caches; verify; advance the weight version."""
        self._expect(State.LOADING, "finish")
        missing = self.layout.expected - self.written
        self.state = State.FAILED  # until every step below succeeded
        _ACTIVE.pop(self.engine, None)
        self._restore_inference_layouts()
        self._refresh_derived_caches()
        if missing:
            raise RefitError(f"refit incomplete: {len(missing)} weights never sent: {listing(missing)}; "
                             "the engine holds a partial refit and weight_version was not advanced; "
                             "run a complete refit")
        if self.verify:
            self._verify()
        self.engine.weight_version += 1
        self.state = State.DONE
        return RefitStats(self.bytes, time.perf_counter() - self._t0, self.engine.weight_version,
                          len(self.written))

    def abort(self) -> None:
        """Leave loading layout without advancing the version (after an error)."""
        if self.state is not State.LOADING:
            return
        self._restore_inference_layouts()
        self._refresh_derived_caches()
        _ACTIVE.pop(self.engine, None)
        self.state = State.FAILED

    def __enter__(self) -> "Refit":
        if self.state is State.NEW:
            self.begin()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self.state is State.LOADING:
            self.stats = self.finish()

    # -- steps only finish()/abort() run, in this order ---------------------------------
    def _restore_inference_layouts(self) -> None:
        for layer in self._linears():
            apply = getattr(layer.method, "apply_inference_layout", None)
            if apply is not None:
                apply(layer)
            else:
                layer.method.process_weights_after_loading(layer)

    def _refresh_derived_caches(self) -> None:
        for _, cache in named_derived_caches(self.engine.model):
            cache.refresh()

    # -- helpers ----------------------------------------------------------------------
    def _linears(self):
        return [m for m in self.engine.model.modules() if isinstance(m, LinearBase)]

    def _expect(self, state: State, step: str) -> None:
        if self.state is not state:
            raise RefitError(f"Refit.{step}() called in state {self.state.value!r}; the order is "
                             "begin() -> load()* -> finish(), once per Refit object")

    def _sent_checksum(self, r, t: torch.Tensor) -> tuple[float, float]:
        """(checksum of the value the engine must now hold for ``t``, tolerance 0).

        The expected value is computed independently of the engine: ``t`` cast to the
        slot dtype, or for FP8 ``dequant(quant(t))`` (whose error against ``t`` is checked
        here against ``abs_error_bound``). Both are deterministic, so the comparison in
        ``finish()`` is exact — a worst-case error tolerance would hide swapped shards.
        """
        if r.fp8:
            block = r.layer.fp8_method.block
            weight = torch.empty(t.shape, dtype=FP8_DTYPE)
            scale = torch.empty(block_scale_shape(*t.shape) if block else (t.shape[0], 1))
            quantize_(t, weight, scale, block=block)
            expected = torch.empty(t.shape, dtype=torch.float32)
            dequantize_(weight, scale, expected)
            if not ((expected - t).abs() <= abs_error_bound(t, scale)).all():
                raise RefitError(f"FP8 quantization of {r.hf_name} exceeds its error bound; "
                                 "check for inf/nan in the trainer weights")
        else:
            expected = t.to(r.param.dtype)
        return V.weighted_sum(expected), 0.0

    def _verify(self) -> None:
        V.check_addresses(self._addresses, V.snapshot(self.engine.named_state_tensors()))
        V.check_derived_caches(named_derived_caches(self.engine.model))
        held = {n: V.weighted_sum(self.layout.routes[n].held()) for n in self._sent}
        V.check_checksums(self._sent, held)


def refit_session(engine, *, verify: bool = False, names: Iterable[str] | None = None) -> Refit:
    """``with refit_session(engine, verify=True) as s: s.load(bucket) ...`` — begin on enter,
    finish on a clean exit (stats in ``s.stats``), abort on an exception."""
    return Refit(engine, verify=verify).begin(names)
