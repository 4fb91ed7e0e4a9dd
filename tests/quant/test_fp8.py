"""FP8 quantize/dequantize in place: exactness of storage, error bound, layouts."""
import pytest
import torch

from hybridrl.quant.fp8 import (BLOCK, FP8_DTYPE, abs_error_bound, block_scale_shape, dequantize_,
                                quantize_, reference_scale)


def _independent_scale(src: torch.Tensor, block: bool) -> torch.Tensor:
    """The scale rule written out, not through ``quantize_``: per row (or per 128x128 tile,
    ragged at the edges) ``max(amax, 1e-12) / 448``, in float64 then rounded to float32."""
    src = src.double()
    if not block:
        return (src.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0).float()
    n, k = src.shape
    rows, cols = -(-n // 128), -(-k // 128)
    out = torch.empty(rows, cols, dtype=torch.float64)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = max(float(src[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].abs().max()), 1e-12) / 448.0
    return out.float()


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
    assert torch.isfinite(out).all()
    # e4m3: 3 mantissa bits (half an ulp is 2^-4 relative), subnormal step 2^-9 (half: 2^-10) —
    # of the *independent* scale, so a too-large scale (coarser grid) fails
    want = _independent_scale(src, block)
    torch.testing.assert_close(s, want, rtol=2 ** -23, atol=0)
    bound = abs_error_bound(src, want).double()
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


# ---- the vectorized (GPU) path: bitwise the stripe loop ---------------------------------------

def _stripe_reference(monkeypatch):
    """Force quantize_/dequantize_ on CPU through the torch stripe loop (no native kernels)."""
    from hybridrl.quant import fp8
    monkeypatch.setattr(fp8, "_quantize_native", lambda *a: False)
    monkeypatch.setattr(fp8, "_dequantize_native", lambda *a: False)


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (7, 5), (129, 129), (640, 64)])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_vectorized_equals_stripe_loop_bitwise(monkeypatch, block, shape, src_dtype):
    from hybridrl.quant import fp8
    monkeypatch.setattr(fp8, "DEVICE_CHUNK_ELEMENTS", 256 * 128)  # several chunks, partial last tile
    _stripe_reference(monkeypatch)
    g = torch.Generator().manual_seed(5)
    src = (torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[1])).to(src_dtype)
    src[1] = 0.0
    w_ref, s_ref = _alloc(*shape, block)
    quantize_(src, w_ref, s_ref, block=block)  # stripe loop
    w, s = _alloc(*shape, block)
    fp8._quantize_vectorized(src, w, s, block)
    assert torch.equal(w.view(torch.uint8), w_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    for out_dtype in (torch.float32, torch.bfloat16):
        ref, out = torch.empty(shape, dtype=out_dtype), torch.empty(shape, dtype=out_dtype)
        dequantize_(w_ref, s_ref, ref)
        fp8._dequantize_vectorized(w_ref, s_ref, out, block)
        assert torch.equal(out, ref)


def test_vectorized_path_serves_every_non_cpu_source(monkeypatch):
    """quantize_/dequantize_ dispatch on the source's device (meta stands in for a GPU)."""
    from hybridrl.quant import fp8
    calls = []
    monkeypatch.setattr(fp8, "_quantize_vectorized", lambda *a: calls.append("q"))
    monkeypatch.setattr(fp8, "_dequantize_vectorized", lambda *a: calls.append("dq"))
    src = torch.empty(256, 128, device="meta")
    w = torch.empty(256, 128, dtype=FP8_DTYPE, device="meta")
    quantize_(src, w, torch.empty(256, 1, device="meta"), block=False)
    dequantize_(w, torch.empty(2, 1, device="meta"), torch.empty(256, 128, device="meta"))
    assert calls == ["q", "dq"]
    cpu_w, cpu_s = _alloc(8, 8, False)
    quantize_(torch.randn(8, 8), cpu_w, cpu_s, block=False)
    dequantize_(cpu_w, cpu_s, torch.empty(8, 8))
    assert calls == ["q", "dq"], "CPU keeps its own (native / stripe) path"


def test_vectorized_chunks_are_whole_tiles_and_few():
    from hybridrl.quant import fp8
    for k in (64, 4096, 11008, 151936):
        rows = fp8._rows_per_chunk(k)
        assert rows % BLOCK == 0 and (rows == BLOCK or rows * k <= fp8.DEVICE_CHUNK_ELEMENTS)
    assert fp8._rows_per_chunk(4096) == 4096  # a 4096 x 4096 weight: one chunk, not 32 stripes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block", [False, True])
def test_gpu_quantization_is_bitwise_the_cpu_one(block):
    g = torch.Generator().manual_seed(6)
    src = (torch.randn(700, 300, generator=g) * torch.logspace(-3, 2, 300)).to(torch.bfloat16)
    w_cpu, s_cpu = _alloc(700, 300, block)
    quantize_(src, w_cpu, s_cpu, block=block)
    w, s = (t.cuda() for t in _alloc(700, 300, block))
    quantize_(src.cuda(), w, s, block=block)
    assert torch.equal(w.cpu().view(torch.uint8), w_cpu.view(torch.uint8)) and torch.equal(s.cpu(), s_cpu)
    out_cpu, out = torch.empty(700, 300), torch.empty(700, 300, device="cuda")
    dequantize_(w_cpu, s_cpu, out_cpu)
    dequantize_(w, s, out)
    assert torch.equal(out.cpu(), out_cpu)


@pytest.mark.parametrize("block", [False, True])
def test_pow2_scales_are_the_smallest_power_of_two_and_survive_a_round_trip_exactly(block):
    """``pow2`` (ue8m0, DeepSeek-V3.1/V4 checkpoints): each scale is 2**ceil(log2(amax/448)),
    computed here in float64; dequantized values re-quantize to the same values (a shipped
    checkpoint's weights come back from a refit unchanged), within the usual error bound."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    src = torch.randn(300, 260, generator=g) * torch.logspace(-3, 2, 260)
    w, s = _alloc(300, 260, block)
    quantize_(src, w, s, block=block, pow2=True)
    d = src.double().abs()
    if block:
        pad = torch.nn.functional.pad(d, (0, (-260) % BLOCK, 0, (-300) % BLOCK))
        amax = pad.view(pad.shape[0] // BLOCK, BLOCK, -1, BLOCK).amax(dim=(1, 3))
    else:
        amax = d.amax(dim=1, keepdim=True)
    assert torch.equal(s.double(), torch.exp2(torch.ceil(torch.log2(amax / 448.0))))
    out = torch.empty(300, 260)
    dequantize_(w, s, out)
    assert ((out - src).abs() <= abs_error_bound(src, s)).all()
    w2, s2 = _alloc(300, 260, block)
    quantize_(out, w2, s2, block=block, pow2=True)
    again = torch.empty(300, 260)
    dequantize_(w2, s2, again)
    assert torch.equal(again, out)


@pytest.mark.parametrize("block", [False, True])
def test_pow2_vectorized_path_equals_the_stripe_loop_bitwise(monkeypatch, block):
    from hybridrl.quant import fp8
    monkeypatch.setattr(fp8, "DEVICE_CHUNK_ELEMENTS", 256 * 128)
    src = torch.randn(300, 200) * torch.logspace(-3, 2, 200)
    w_ref, s_ref = _alloc(300, 200, block)
    quantize_(src, w_ref, s_ref, block=block, pow2=True)
    w, s = _alloc(300, 200, block)
    fp8._quantize_vectorized(src, w, s, block, pow2=True)
    assert torch.equal(w.view(torch.uint8), w_ref.view(torch.uint8)) and torch.equal(s, s_ref)
