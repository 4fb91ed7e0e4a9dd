"""Refit verification: address stability and content checksums.

Two independent checks, both run by ``Refit(verify=True)``:

1. **Addresses.** Before ``begin()``, record ``(data_ptr, shape, dtype, stride)`` of every
   tensor in ``engine.named_state_tensors()`` (parameters, buffers, derived caches, KV
   cache, graph-held tensors); after ``finish()``, every record must be identical and no
   tensor may have appeared or vanished. A cache dropped and rebuilt, a parameter rebound
   by a load, a re-laid-out weight in new storage: all fail here.
2. **Contents.** For every tensor the trainer sent, a position-weighted float64 checksum
   of the value the engine *must* hold is taken on arrival: ``route.expected_held(t)``,
   which the slot's linear method computes independently of the engine's storage (the
   tensor cast to the slot dtype, or for FP8 its dequantized quantization, checked against
   ``hybridrl.quant.abs_error_bound``). After ``finish()`` the same checksum of
   ``route.held()`` (the fused slice; for FP8 its float32 dequantization, in whichever
   layout) must be equal: both sides are deterministic, so the comparison is exact. A worst-case-error tolerance would be ~n·2⁻⁴·|w| and hide a
   swapped k/v shard; exactness does not. The position weights make swapped or
   transposed slices visible even when plain sums agree.
Plus: every registered derived cache must equal a fresh recomputation from its sources,
bit for bit (a stale or skipped cache fails here).

Host syncs: a checksum is a 0-d float64 tensor on the tensor's device
(:func:`weighted_sum_tensor`; its 1M-element chunks are added on the device, in the same
order and with the same float64 adds as a host loop would), and :func:`to_floats` brings
a whole dict of them to the host with one transfer per device. On a GPU a verified refit
then syncs once at the end, not once per chunk of every tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from hybridrl.refit.errors import RefitError, listing

CHUNK = 1 << 20  # elements per float64 temporary
PERIOD = 1021  # position weights 1 + (i mod PERIOD) / PERIOD


@dataclass(frozen=True)
class TensorRecord:
    data_ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]

    @staticmethod
    def of(t: torch.Tensor) -> "TensorRecord":
        return TensorRecord(t.data_ptr(), tuple(t.shape), t.dtype, tuple(t.stride()))


def snapshot(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, TensorRecord]:
    return {name: TensorRecord.of(t) for name, t in named_tensors}


def check_addresses(before: dict[str, TensorRecord], after: dict[str, TensorRecord]) -> None:
    """Raise ``RefitError`` naming every tensor whose storage or geometry changed."""
    changed = [n for n in before.keys() & after.keys() if before[n] != after[n]]
    gone, new = before.keys() - after.keys(), after.keys() - before.keys()
    if changed or gone or new:
        parts = [f"{label}: {listing(names)}" for label, names in
                 (("moved/reshaped", changed), ("removed", gone), ("appeared", new)) if names]
        raise RefitError("refit changed engine tensor addresses (a captured graph would read "
                         "stale memory) — " + "; ".join(parts)
                         + "; write into existing storage and register derived caches")


def _weights(start: int, n: int, device) -> torch.Tensor:
    i = torch.arange(start, start + n, device=device, dtype=torch.float64)
    return i.remainder_(PERIOD).div_(PERIOD).add_(1.0)


def weighted_sum_tensor(t: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i * t_i`` in float64 over the flattened tensor (chunked), as a 0-d tensor
    on ``t``'s device: no host sync (the kernels read ``t`` in stream order)."""
    flat = t.detach().reshape(-1)
    total = None
    for s in range(0, flat.numel(), CHUNK):
        x = flat[s:s + CHUNK].to(torch.float64)  # may alias the input: never write into x
        part = torch.mul(x, _weights(s, x.numel(), x.device)).sum()
        total = part if total is None else total + part
    return torch.zeros((), dtype=torch.float64, device=flat.device) if total is None else total


def weighted_sum(t: torch.Tensor) -> float:
    """:func:`weighted_sum_tensor` as a Python float (one host sync)."""
    return float(weighted_sum_tensor(t))


def to_floats(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-d tensors -> Python floats, one device-to-host transfer per device."""
    by_device: dict[torch.device, list[str]] = {}
    for name, v in values.items():
        by_device.setdefault(v.device, []).append(name)
    out: dict[str, float] = {}
    for names in by_device.values():
        out.update(zip(names, torch.stack([values[n] for n in names]).tolist()))
    return out


def check_checksums(sent: dict[str, tuple[float, float]], held: dict[str, float]) -> None:
    """``sent[name] = (checksum, tolerance)``, ``held[name] = checksum``; raise on mismatch."""
    bad = []
    for name, (c_sent, tol) in sent.items():
        c_held = held[name]
        slack = 1e-9 * (abs(c_sent) + tol) + 1e-12  # float64 summation noise
        if abs(c_held - c_sent) > tol + slack:
            bad.append(f"{name} (sent {c_sent:.6g}, engine {c_held:.6g}, tol {tol:.3g})")
    if bad:
        raise RefitError("engine weights differ from what the trainer sent: " + listing(bad)
                         + "; a loader wrote the wrong slot or a layout step corrupted it")


def check_derived_caches(named_caches) -> None:
    """Every derived cache must equal a fresh recomputation from its sources, exactly."""
    stale = [name for name, cache in named_caches if not torch.equal(cache.tensor, cache.expected())]
    if stale:
        raise RefitError(f"stale derived caches after refit: {listing(stale)}; "
                         "register them so Refit.finish() refreshes them in place")
