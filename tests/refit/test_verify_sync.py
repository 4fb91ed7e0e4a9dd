"""Verification brings checksums to the host once per device per refit, not once per chunk.

Checksums stay 0-d float64 device tensors (``weighted_sum_tensor``) until ``to_floats``;
their value is exactly what the host loop (one ``float()`` per 1M-element chunk) gave.
"""
import pytest
import torch

from hybridrl.refit import refit_from_model
from hybridrl.refit import verify as V
from tests.refit.helpers import engine, hf_model, perturb, qwen2_config


def _host_loop(t: torch.Tensor) -> float:
    """The previous implementation: a host sync per chunk."""
    flat, total = t.detach().reshape(-1), 0.0
    for s in range(0, flat.numel(), V.CHUNK):
        x = flat[s:s + V.CHUNK].to(torch.float64)
        total += float(torch.mul(x, V._weights(s, x.numel(), x.device)).sum())
    return total


@pytest.mark.parametrize("n", [0, 1, 1000, 4099])
def test_device_checksum_equals_the_host_loop(monkeypatch, n):
    monkeypatch.setattr(V, "CHUNK", 512)  # several chunks
    t = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    c = V.weighted_sum_tensor(t)
    assert c.dim() == 0 and c.dtype == torch.float64 and c.device == t.device
    assert float(c) == _host_loop(t) == V.weighted_sum(t)


def test_to_floats_one_transfer_per_device(monkeypatch):
    values = {"a": torch.tensor(1.5, dtype=torch.float64), "b": torch.tensor(-2.0, dtype=torch.float64)}
    stacks = []
    real = torch.stack
    monkeypatch.setattr(torch, "stack", lambda ts, *a, **k: stacks.append(len(ts)) or real(ts, *a, **k))
    assert V.to_floats(values) == {"a": 1.5, "b": -2.0}
    assert stacks == [2]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_verified_refit_syncs_once_per_side(monkeypatch, quantization):
    cfg = qwen2_config()
    hf, eng = hf_model(cfg), engine(cfg, quantization)
    refit_from_model(eng, hf)
    perturb(hf, seed=2)
    monkeypatch.setattr(V, "CHUNK", 4096)  # many chunks per tensor
    monkeypatch.setattr(V, "weighted_sum", lambda t: pytest.fail("a per-tensor host sync in verify"))
    conversions = []
    real = V.to_floats
    monkeypatch.setattr(V, "to_floats", lambda values: conversions.append(len(values)) or real(values))
    stats = refit_from_model(eng, hf, verify=True)
    n = len(eng.expected_weight_names())
    assert stats.version == 2 and conversions == [n, n]  # held, then sent: one call each
