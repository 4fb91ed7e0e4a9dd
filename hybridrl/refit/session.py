"""The refit protocol: ``begin()`` → ``load(bucket)``* → ``finish()``, as a state machine.

Why the order is enforced and not documented in a comment: the real bugs were order
bugs. A derived cache refreshed before the quantized weights were back in their
inference layout was computed from staging data; a cache dropped and lazily rebuilt
after refit moved to a new address under a captured CUDA graph. The engine owns the
in-place part of that order (its weight-update bracket: loading layouts on begin;
inference layouts, *then* derived caches on finish; recording the ``weight_version`` it is
handed — the publisher's, the one owner of that number — or +1 when none is).
A ``Refit`` adds the protocol around it:

- ``begin(names)``  checks the announced name set against the engine's route table,
                    snapshots addresses (``verify=True``), opens the engine's update;
- ``load(bucket)``  validates the whole bucket first, takes the expected checksums
                    (``verify=True``), then hands it to ``engine.load_weights``;
- ``finish()``      requires every name sent, closes the engine's update with the
                    verifier as its ``check`` and the refit's ``version`` (a failed
                    check commits nothing).

Any other call order raises ``RefitError``. Nothing here touches an engine private: the
engine's public bracket, its route table and ``named_state_tensors()`` are the interface.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from hybridrl.refit import names as N
from hybridrl.refit import verify as V
from hybridrl.refit.bucket import nbytes
from hybridrl.refit.errors import RefitError, listing
from hybridrl.rollout.backend import check_weight_version


class State(enum.Enum):
    NEW = "new"
    LOADING = "loading"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class RefitStats:
    bytes_moved: int  # bytes of trainer tensors received
    seconds: float  # begin() to the end of finish()
    version: int  # engine.weight_version after this refit (the one it was handed)
    num_tensors: int

    @property
    def gbps(self) -> float:
        return self.bytes_moved / max(self.seconds, 1e-12) / 1e9


class Refit:
    """One refit of ``engine``. Use ``refit_session(engine)`` or call the steps yourself."""

    def __init__(self, engine, *, verify: bool = False, version: int | None = None):
        """``version``: the weight version this refit publishes, decided by the caller (the
        trainer's batch source) and recorded by the engine; None: the engine's + 1."""
        if version is not None:
            check_weight_version(version)  # refused before anything is sent
        self.engine, self.verify, self.version = engine, verify, version
        self.routes = engine.weight_routes
        self.state = State.NEW
        self.written: set[str] = set()
        self.bytes = 0
        self._sent: dict[str, torch.Tensor] = {}  # name -> expected checksum, 0-d, on the sent tensor's device
        self._addresses: dict[str, V.TensorRecord] = {}
        self._partial: frozenset[str] | None = None
        self._t0 = 0.0

    # -- protocol ---------------------------------------------------------------------
    def begin(self, names: Iterable[str] | None = None, *, partial: bool = False) -> "Refit":
        """Announce the names to be sent (default: all) and open the engine's weight update.
        ``partial``: ``names`` is a subset of the engine's (a LoRA refit: the adapters, or the
        merged targeted weights); exactly those must then be sent, the rest keep their values."""
        self._expect(State.NEW, "begin")
        if self.engine.weight_update_in_progress:
            raise RefitError("another weight update of this engine is in progress; finish() or abort() it first")
        if partial and names is None:
            raise RefitError("a partial refit announces its names: begin(names, partial=True)")
        names = list(self.routes.expected if names is None else names)
        N.check_announced(self.routes, names, partial=partial)
        self._partial = frozenset(names) - self.routes.ignored if partial else None
        self._t0 = time.perf_counter()
        if self.verify:
            self._addresses = V.snapshot(self.engine.named_state_tensors())
        if partial:
            self.engine.begin_weight_update(required=self._partial)
        else:
            self.engine.begin_weight_update()
        self.state = State.LOADING
        return self

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Validate one bucket as a whole, then write it in place."""
        self._expect(State.LOADING, "load")
        named = [(n, t.detach()) for n, t in named_tensors]
        try:
            kept = N.check_bucket(self.routes, named, self.written)
        except RefitError as e:
            self.abort()
            if self.written:
                raise RefitError(f"{e} (but {len(self.written)} earlier tensors of this refit were "
                                 "written: the engine holds a partial refit; run a complete one)") from None
            raise
        if self.verify:
            for name, t in kept:  # before the write: a bucket view is reused afterwards
                self._sent[name] = self._expected_checksum(name, t)
        self.engine.load_weights(kept)
        self.written.update(n for n, _ in kept)
        self.bytes += sum(nbytes(t) for _, t in kept)

    def finish(self) -> RefitStats:
        """Close the engine's update (layouts, then caches, then ``verify``); it records the version."""
        self._expect(State.LOADING, "finish")
        missing = N._missing(self.routes, self.written) if self._partial is None else self._partial - self.written
        self.state = State.FAILED  # until every step below succeeded
        if missing:
            self.engine.abort_weight_update()  # layouts and caches consistent, version unchanged
            raise RefitError(f"refit incomplete: {len(missing)} weights never sent: {listing(missing)}; "
                             "the engine holds a partial refit and weight_version was not advanced; "
                             "run a complete refit")
        version = self.engine.finish_weight_update(check=self._verify if self.verify else None,
                                                   version=self.version)
        self.state = State.DONE
        return RefitStats(self.bytes, time.perf_counter() - self._t0, version, len(self.written))

    def abort(self) -> None:
        """Leave loading layout without advancing the version (after an error)."""
        if self.state is not State.LOADING:
            return
        self.state = State.FAILED
        self.engine.abort_weight_update()

    def __enter__(self) -> "Refit":
        if self.state is State.NEW:
            self.begin()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self.state is State.LOADING:
            self.stats = self.finish()

    # -- helpers ----------------------------------------------------------------------
    def _expect(self, state: State, step: str) -> None:
        if self.state is not state:
            raise RefitError(f"Refit.{step}() called in state {self.state.value!r}; the order is "
                             "begin() -> load()* -> finish(), once per Refit object")

    def _expected_checksum(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Checksum (0-d, on ``t``'s device, not synced) of the value the engine must hold for
        ``t`` after the write; compared with tolerance 0.

        The route's linear method computes that value independently of the engine's storage
        (``t`` cast to the slot dtype; for FP8 ``dequant(quant(t))`` on ``t``'s device, whose
        error is checked against ``abs_error_bound``). Both sides are deterministic, so the
        comparison in ``finish()`` is exact — a worst-case error tolerance would hide
        swapped shards.
        """
        try:
            expected = self.routes[name].expected_held(t)
        except ValueError as e:
            raise RefitError(f"{name}: {e}") from None
        return V.weighted_sum_tensor(expected)

    def _verify(self) -> None:
        V.check_addresses(self._addresses, V.snapshot(self.engine.named_state_tensors()))
        V.check_derived_caches(self.engine.named_derived_caches())
        held = V.to_floats({n: V.weighted_sum_tensor(self.routes[n].held()) for n in self._sent})
        sent = V.to_floats(self._sent)  # one host sync per device for the whole refit
        V.check_checksums({n: (c, 0.0) for n, c in sent.items()}, held)


def refit_session(engine, *, verify: bool = False, names: Iterable[str] | None = None,
                  partial: bool = False, version: int | None = None) -> Refit:
    """``with refit_session(engine, verify=True) as s: s.load(bucket) ...`` — begin on enter,
    finish on a clean exit (stats in ``s.stats``), abort on an exception."""
    return Refit(engine, verify=verify, version=version).begin(names, partial=partial)
