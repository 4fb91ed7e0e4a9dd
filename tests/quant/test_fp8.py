"""FP8 quantize/dequantize in place: exactness of storage, error bound, layouts."""
import pytest
import torch

from hybridrl.quant.fp8 import (BLOCK, FP8_DTYPE, abs_error_bound, block_scale_shape, dequantize_,
                                quantize_, reference_scale)


def _alloc(n, k, block):
    w = torch.empty(n, k, dtype=FP8_DTYPE)
    s = torch.empty(block_scale_shape(n, k) if block else (n, 1), dtype=torch.float32)
    return w, s


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (7, 5)])
def test_roundtrip_within_bound_and_in_place(block, shape):
    g = torch.Generator().manual_seed(0)
    src = torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[1])  # wide dynamic range
    src[0] = 0.0  # an all-zero row must not produce inf/nan
    w, s = _alloc(*shape, block)
    ptrs = (w.data_ptr(), s.data_ptr())
    quantize_(src, w, s, block=block)
    assert (w.data_ptr(), s.data_ptr()) == ptrs
    out = torch.empty(shape, dtype=torch.float64)
    dequantize_(w, s, out)
    err = (out - src.double()).abs()
    bound = abs_error_bound(src, s).double()
    assert torch.isfinite(out).all()
    assert (err <= bound).all(), float((err - bound).max())
    assert torch.equal(s, reference_scale(src, block=block))


def test_per_channel_rows_are_independent_slices():
    """Quantizing shards into row slices equals quantizing the concatenation."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 32, generator=g), torch.randn(96, 32, generator=g) * 10
    w, s = _alloc(160, 32, False)
    quantize_(a, w[:64], s[:64], block=False)
    quantize_(b, w[64:], s[64:], block=False)
    w2, s2 = _alloc(160, 32, False)
    quantize_(torch.cat([a, b]), w2, s2, block=False)
    assert torch.equal(w.view(torch.uint8), w2.view(torch.uint8)) and torch.equal(s, s2)


def test_block_shards_on_tile_boundaries_match_whole():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(BLOCK, 200, generator=g), torch.randn(70, 200, generator=g)
    w, s = _alloc(BLOCK + 70, 200, True)
    quantize_(a, w[:BLOCK], s[:1], block=True)
    quantize_(b, w[BLOCK:], s[1:], block=True)
    w2, s2 = _alloc(BLOCK + 70, 200, True)
    quantize_(torch.cat([a, b]), w2, s2, block=True)
    assert torch.equal(w.view(torch.uint8), w2.view(torch.uint8)) and torch.equal(s, s2)


def test_requantize_is_idempotent_no_scale_drift():
    """Quantizing dequantized values again reproduces the same bits and scale (no doubling)."""
    src = torch.randn(128, 256, generator=torch.Generator().manual_seed(3))
    w, s = _alloc(128, 256, True)
    quantize_(src, w, s, block=True)
    deq = torch.empty(128, 256)
    dequantize_(w, s, deq)
    w2, s2 = _alloc(128, 256, True)
    quantize_(deq, w2, s2, block=True)
    assert torch.equal(s, s2) and torch.equal(w.view(torch.uint8), w2.view(torch.uint8))
