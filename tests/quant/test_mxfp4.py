"""MXFP4 against a float64 reference of the OCP Microscaling rules written from the spec
(hand-derived E2M1 table, scale choice, round-half-to-even, saturation, zero / NaN / inf blocks)."""
import math

import pytest
import torch

from hybridrl.quant import mxfp4

# E2M1: sign | 2 exponent bits (bias 1) | 1 mantissa bit. Exponent 0 is subnormal:
# 0.m * 2**0 -> 0, 0.5; exponent e >= 1: 1.m * 2**(e - 1) -> 1, 1.5, 2, 3, 4, 6.
E2M1_TABLE = {0b000: 0.0, 0b001: 0.5, 0b010: 1.0, 0b011: 1.5, 0b100: 2.0, 0b101: 3.0, 0b110: 4.0, 0b111: 6.0}


def ref_quantize_block(block: list[float]) -> tuple[int, list[int]]:
    """(E8M0 bits, codes) of one 32-element block, in float64 from the OCP v1.0 rules."""
    amax = max(abs(v) for v in block) if not any(math.isnan(v) for v in block) else math.nan
    if math.isnan(amax) or math.isinf(amax):
        return 255, [0] * len(block)
    if amax == 0.0:
        shared = -127
    else:
        m, e = math.frexp(amax)  # amax = m * 2**e, 0.5 <= m < 1
        shared = max(-127, min(127, (e - 1) - 2))  # floor(log2(amax)) - emax(E2M1) = 2
    codes = []
    for v in block:
        y = v / 2.0 ** shared
        a = min(abs(y), 6.0)  # saturate to the largest normal
        best = min(E2M1_TABLE, key=lambda c: (abs(E2M1_TABLE[c] - a), c & 1))  # nearest, ties to even
        codes.append(best | (8 if math.copysign(1.0, y) < 0 else 0))
    return shared + 127, codes


def ref_value(bits: int, code: int) -> float:
    if bits == 255:
        return math.nan
    mag = E2M1_TABLE[code & 7] * 2.0 ** (bits - 127)
    return -mag if code & 8 else mag


def unpack(blocks: torch.Tensor) -> list[int]:
    out = []
    for byte in blocks.reshape(-1).tolist():
        out += [byte & 0xF, byte >> 4]  # element 2j in the low nibble
    return out


def test_every_code_decodes_to_the_hand_table():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).view(1, 8)
    vals = mxfp4.codes_to_float32(packed).view(-1)
    for c in range(16):
        want = E2M1_TABLE[c & 7] * (-1 if c & 8 else 1)
        assert vals[c].item() == want and math.copysign(1, vals[c].item()) == (-1 if c & 8 else 1), c


def test_e8m0_scale_values():
    bits = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = mxfp4.e8m0_to_float32(bits).tolist()
    assert got[:6] == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127] and math.isnan(got[6])
    if mxfp4.E8M0_DTYPE is not None:  # torch's own e8m0 agrees
        torch.testing.assert_close(bits.view(mxfp4.E8M0_DTYPE).float(), mxfp4.e8m0_to_float32(bits), equal_nan=True)


def _check_against_reference(src: torch.Tensor) -> None:
    blocks, scales = mxfp4.quantize(src)
    flat = src.double().reshape(-1, mxfp4.BLOCK).tolist()
    got_codes, got_bits = unpack(blocks), scales.reshape(-1).tolist()
    for i, block in enumerate(flat):
        bits, codes = ref_quantize_block(block)
        assert got_bits[i] == bits, (i, block)
        if bits != 255:
            assert got_codes[i * 32:(i + 1) * 32] == codes, (i, block)
    deq = mxfp4.dequantize(blocks, scales).reshape(-1).tolist()
    for i, (b, c) in enumerate(zip([got_bits[j // 32] for j in range(len(got_codes))], got_codes)):
        want = ref_value(b, c)
        assert (math.isnan(want) and math.isnan(deq[i])) or deq[i] == want, i


def test_random_blocks_match_reference():
    g = torch.Generator().manual_seed(0)
    src = torch.randn(6, 128, generator=g) * torch.logspace(-4, 4, 128)  # wide range across blocks
    _check_against_reference(src)


def test_ties_round_to_even_and_saturation():
    # with amax 4 (block max 4 -> shared exponent 0) the scaled values are the values themselves
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0]
    near = [0.2499, 0.2501, 0.7499, 2.4999, 2.5001, 4.9999, 5.0001, 5.9, 6.0]
    block = ties + near + [4.0] + [0.0] * (32 - len(ties) - len(near) - 1)
    blocks, scales = mxfp4.quantize(torch.tensor([block]))
    assert scales.item() == 127
    got = mxfp4.dequantize(blocks, scales)[0].tolist()
    assert got[:10] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, -4.0]
    assert got[10:19] == [0.0, 0.5, 0.5, 2.0, 3.0, 4.0, 6.0, 6.0, 6.0]
    # saturation: amax 7.9 also has shared exponent 0 (floor(log2 7.9) = 2), 7.9 -> 6
    blocks, scales = mxfp4.quantize(torch.tensor([[7.9, -7.0, 6.5] + [0.0] * 29]))
    assert scales.item() == 127 and mxfp4.dequantize(blocks, scales)[0, :3].tolist() == [6.0, -6.0, 6.0]
    _check_against_reference(torch.tensor([block]))


def test_zero_tiny_huge_nan_inf_blocks():
    rows = torch.zeros(6, 32)
    rows[1, 3] = 1e-40  # subnormal float32: exponent clamps to -127, value flushes to 0
    rows[2, 0] = 3.0e38  # near float32 max: shared exponent 125
    rows[3, 5] = float("nan")
    rows[4, 7] = float("inf")
    rows[5, :] = -0.0
    blocks, scales = mxfp4.quantize(rows)
    assert scales.view(-1).tolist() == [0, 0, 252, 255, 255, 0]
    deq = mxfp4.dequantize(blocks, scales)
    assert deq[0].eq(0).all() and deq[1].eq(0).all() and deq[5].eq(0).all()
    assert torch.signbit(deq[5]).all()  # -0 keeps its sign
    assert deq[2, 0].item() == 1.5 * 2.0 ** 127 * 1.0  # 3e38 / 2**125 = 7.05 -> saturates to 6 * 2**125
    assert deq[3].isnan().all() and deq[4].isnan().all()  # the whole block is NaN
    _check_against_reference(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_bound_and_in_place(dtype):
    g = torch.Generator().manual_seed(1)
    src = (torch.randn(3, 40, 256, generator=g) * torch.logspace(-3, 3, 256)).to(dtype)
    blocks = torch.empty(mxfp4.blocks_shape(src.shape), dtype=torch.uint8)
    scales = torch.empty(mxfp4.scales_shape(src.shape), dtype=torch.uint8)
    ptrs = (blocks.data_ptr(), scales.data_ptr())
    mxfp4.quantize_(src, blocks, scales)
    out = torch.empty(src.shape, dtype=torch.float64)
    mxfp4.dequantize_(blocks, scales, out)
    assert (blocks.data_ptr(), scales.data_ptr()) == ptrs
    err, bound = (out - src.double()).abs(), mxfp4.abs_error_bound(src, scales).double()
    assert (err <= bound).all()
    assert (err / bound).max() > 0.9  # the bound is tight, not a loose tolerance
    # dequantization is exact in bf16 (2 significant bits times a power of two)
    out_bf16 = torch.empty(src.shape, dtype=torch.bfloat16)
    mxfp4.dequantize_(blocks, scales, out_bf16)
    assert torch.equal(out_bf16.double(), out)


def test_requantize_is_idempotent_and_slices_are_independent():
    g = torch.Generator().manual_seed(2)
    src = torch.randn(16, 96, generator=g)
    blocks, scales = mxfp4.quantize(src)
    again = mxfp4.quantize(mxfp4.dequantize(blocks, scales))
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)
    # rows are quantized independently: writing a row slice equals quantizing the whole
    b2, s2 = torch.zeros_like(blocks), torch.zeros_like(scales)
    mxfp4.quantize_(src[:5], b2[:5], s2[:5])
    mxfp4.quantize_(src[5:], b2[5:], s2[5:])
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.blocks_shape((4, 48))
    with pytest.raises(ValueError, match="do not fit"):
        mxfp4.quantize_(torch.zeros(2, 64), torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    if mxfp4.FP4_DTYPE is not None:  # torch's packed dtype is a zero-copy view of the storage
        blocks, _ = mxfp4.quantize(torch.randn(2, 64))
        assert blocks.view(mxfp4.FP4_DTYPE).data_ptr() == blocks.data_ptr()
