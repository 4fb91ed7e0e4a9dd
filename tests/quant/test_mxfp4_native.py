"""The fused CPU MXFP4 kernels (hybridrl/quant/mxfp4_kernels.c) against torch, bit for bit.

The torch path of hybridrl.quant.mxfp4 is the reference (itself checked against the OCP
rules in test_mxfp4.py): every test runs both and demands identical bytes (E8M0 scales,
packed E2M1 codes, dequantized values, NaN bits included), on fresh random data: normal,
heavy-tailed, zero / -0 / NaN / inf blocks, subnormal scales and elements, near float32 max.
"""
import os
import subprocess
import sys

import pytest
import torch

from hybridrl.quant import mxfp4, native

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler on this machine")

KINDS = ["normal", "heavy_tailed", "specials", "subnormal_scales"]


@pytest.fixture(scope="module")
def lib():
    lib = native.kernels()
    assert lib is not None, "a C compiler is present, so the MXFP4 kernels must build"
    return lib


@pytest.fixture
def torch_path(monkeypatch):
    """Call ``fn(*args)`` with the native kernels switched off."""
    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(native, "kernels", lambda: None)
            return fn(*args)
    return run


@pytest.fixture
def calls(monkeypatch):
    """Names of the kernels ``native.run_split`` ran (so a comparison is never torch vs torch)."""
    seen, run_split = [], native.run_split

    def spy(fn, *args):
        seen.append(fn.__name__)
        return run_split(fn, *args)
    monkeypatch.setattr(native, "run_split", spy)
    return seen


def _generator() -> torch.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown by pytest on failure
    return torch.Generator().manual_seed(seed)


def _data(kind: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """float32 ``shape`` of one kind; per-block magnitudes vary so blocks get different scales."""
    *lead, k = shape
    per_block = (*lead, k // mxfp4.BLOCK, 1)

    def block_exp(lo, hi):
        return torch.exp2(torch.randint(lo, hi, per_block, generator=g).float())

    x = torch.randn(*lead, k // mxfp4.BLOCK, mxfp4.BLOCK, generator=g)
    if kind == "normal":
        pass
    elif kind == "heavy_tailed":  # Cauchy: a few huge elements per block next to tiny ones
        x = torch.tan(torch.pi * (torch.rand(x.shape, generator=g) - 0.5)) * block_exp(-30, 30)
    elif kind == "subnormal_scales":  # amax around 2**-149 .. 2**-118: scale bits 0..6, subnormal elements
        x = x * block_exp(-150, -118)
    elif kind == "specials":
        x = x * block_exp(-150, 128)  # the whole float32 range; the top overflows to inf
        flat = x.view(-1, mxfp4.BLOCK)  # (blocks, 32), a view of x
        n = flat.shape[0]
        pick = torch.randperm(n, generator=g)
        flat[pick[0::9]] = 0.0
        flat[pick[1::9]] = -0.0
        flat[pick[2::9], torch.randint(0, 32, (len(pick[2::9]),), generator=g)] = float("nan")
        flat[pick[3::9], torch.randint(0, 32, (len(pick[3::9]),), generator=g)] = float("inf")
        flat[pick[4::9], 0] = -float("inf")
        flat[pick[5::9]] *= 2.0 ** -100  # mixed tiny and not
        flat[pick[6::9], :16] = 3.4e38  # near float32 max: scale 252, saturating elements
        flat[pick[7::9], 5] = -float("nan")
    return x.reshape(shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit for bit, except that any NaN equals any NaN: the payload is not a value, and
    torch's own cast writes different NaN bits per kernel set (0xFFFF vectorized,
    0x7FC0 with ATEN_CPU_CAPABILITY=default)."""
    if a.is_floating_point():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        assert torch.equal(nan_a, nan_b), f"{what}: NaN at different places"
        a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    bad = (_bits(a) != _bits(b)).nonzero()
    assert len(bad) == 0, f"{what}: {len(bad)} mismatches, first at {bad[:4].tolist()}"


def _empty_pair(shape):
    return (torch.empty(mxfp4.blocks_shape(shape), dtype=torch.uint8),
            torch.empty(mxfp4.scales_shape(shape), dtype=torch.uint8))


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 32), (7, 64), (3, 40, 256), (8, 64, 96)])
def test_quantize_dequantize_equal_torch_path_in_place(lib, torch_path, calls, src_dtype, kind, shape):
    src = _data(kind, shape, _generator()).to(src_dtype)
    ours, ref = _empty_pair(shape), _empty_pair(shape)
    ptrs = [t.data_ptr() for t in ours]
    mxfp4.quantize_(src, *ours)
    torch_path(mxfp4.quantize_, src, *ref)
    assert calls == ["hrl_mxfp4_quantize"]
    assert [t.data_ptr() for t in ours] == ptrs  # written in place
    _assert_same(ours[1], ref[1], "scales")
    _assert_same(ours[0], ref[0], "packed codes")
    for out_dtype in (torch.float32, torch.bfloat16):
        a, b = torch.empty(shape, dtype=out_dtype), torch.empty(shape, dtype=out_dtype)
        ptr = a.data_ptr()
        mxfp4.dequantize_(*ours, a)
        torch_path(mxfp4.dequantize_, *ours, b)
        assert a.data_ptr() == ptr
        _assert_same(a, b, f"dequantized {out_dtype}")
    assert calls == ["hrl_mxfp4_quantize"] + ["hrl_mxfp4_dequantize"] * 2


def test_every_bfloat16_and_rounding_boundary(lib, torch_path):
    g = _generator()
    # all 65536 bf16 patterns, shuffled into blocks (NaN / inf ones poison their blocks)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    src = every[torch.randperm(every.numel(), generator=g)].view(-1, 256)
    # float32 values a few ulps around every E2M1 threshold and grid point, with block max 4
    # (scale bits 127: y is the value itself) so ties and near-ties decide the codes
    points = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 7.99])
    near = (points.view(torch.int32)[:, None] + torch.arange(-3, 4, dtype=torch.int32)).view(torch.float32).flatten()
    near = torch.cat([near, -near, torch.zeros((-2 * near.numel()) % 31)])
    near = torch.stack([torch.cat([torch.tensor([4.0]), c]) for c in near.split(31)])
    for x in (src, src.float(), near):
        ours, ref = mxfp4.quantize(x), torch_path(mxfp4.quantize, x)
        _assert_same(ours[1], ref[1], "scales")
        _assert_same(ours[0], ref[0], "packed codes")


def test_random_bytes_dequantize_like_torch(lib, torch_path):
    """Any bytes (a checkpoint's, NaN scale 255 and overflowing ones included) decode alike."""
    g = _generator()
    blocks = torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (64, 8), dtype=torch.uint8, generator=g)
    scales[0, :3] = torch.tensor([0, 254, 255], dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        _assert_same(mxfp4.dequantize(blocks, scales, dtype), torch_path(mxfp4.dequantize, blocks, scales, dtype),
                     f"dequantized {dtype}")


def test_strided_slots_are_written_in_place_and_nothing_else(lib, torch_path, calls):
    """A per-expert slot of a fused stack (row stride of the whole row, an offset) from a source
    whose rows are strided: only the slot's bytes change, and they equal the torch path's."""
    g = _generator()
    big = _data("specials", (40, 96 + 64), g).to(torch.bfloat16)
    src = big[:, 32:32 + 96]  # (40, 96), row stride 160
    blocks = torch.full((4, 80, 48), 0xAB, dtype=torch.uint8)  # [E, 2I, K/2]
    scales = torch.full((4, 80, 3), 0xCD, dtype=torch.uint8)
    before = (blocks.clone(), scales.clone())
    mxfp4.quantize_(src, blocks[2, 40:], scales[2, 40:])
    assert calls == ["hrl_mxfp4_quantize"]
    ref = torch_path(mxfp4.quantize, src)
    _assert_same(blocks[2, 40:], ref[0], "packed codes")
    _assert_same(scales[2, 40:], ref[1], "scales")
    blocks[2, 40:], scales[2, 40:] = before[0][2, 40:], before[1][2, 40:]
    assert torch.equal(blocks, before[0]) and torch.equal(scales, before[1])
    padded = torch.full((40, 96 + 16), -7.0)
    out = padded[:, 8:8 + 96]  # strided output rows
    mxfp4.dequantize_(*ref, out)
    _assert_same(out.contiguous(), torch_path(mxfp4.dequantize, *ref), "dequantized")
    assert (padded[:, :8] == -7).all() and (padded[:, -8:] == -7).all()


def test_thread_split_gives_the_same_bytes(lib, monkeypatch):
    monkeypatch.setattr(native, "MIN_ELEMENTS_PER_THREAD", 1 << 12)  # split even a small stack
    src = _data("heavy_tailed", (1030, 320), _generator()).to(torch.bfloat16)
    results, threads = [], torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            blocks, scales = mxfp4.quantize(src)
            results.append((blocks, scales, _bits(mxfp4.dequantize(blocks, scales, torch.bfloat16))))
    finally:
        torch.set_num_threads(threads)
    for r in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], r))


def test_other_dtypes_take_the_torch_path(lib, calls):
    src = torch.randn(4, 64, dtype=torch.float16)
    blocks, scales = mxfp4.quantize(src)
    mxfp4.dequantize(blocks, scales, torch.float64)
    assert calls == []
    torch.testing.assert_close(mxfp4.dequantize(blocks, scales), mxfp4.dequantize(*mxfp4.quantize(src.float())))


def test_portable_build_without_avx2_matches_torch_path(lib, torch_path, monkeypatch, tmp_path):
    """The scalar C path (what a CPU without AVX2 runs): the sources built without -march=native."""
    so = tmp_path / "portable.so"
    subprocess.run([native._compiler(), *native.FLAGS, *map(str, native.SOURCES), "-o", str(so)], check=True)
    portable = native.ctypes.CDLL(str(so))
    for name, argtypes in native._SIGNATURES.items():
        fn = getattr(portable, name)
        fn.argtypes, fn.restype = argtypes, None
    g = _generator()
    for kind in KINDS:
        for dtype in (torch.float32, torch.bfloat16):
            src = _data(kind, (5, 33, 128), g).to(dtype)
            ref = torch_path(mxfp4.quantize, src)
            with monkeypatch.context() as m:
                m.setattr(native, "kernels", lambda: portable)
                ours = mxfp4.quantize(src)
                deq = [mxfp4.dequantize(*ours, d) for d in (torch.float32, torch.bfloat16)]
            _assert_same(ours[0], ref[0], f"{kind} {dtype} packed codes")
            _assert_same(ours[1], ref[1], f"{kind} {dtype} scales")
            for d, a in zip((torch.float32, torch.bfloat16), deq):
                _assert_same(a, torch_path(mxfp4.dequantize, *ref, d), f"{kind} {dtype} dequantized {d}")


def test_missing_compiler_falls_back_to_torch(tmp_path):
    code = ("import torch; from hybridrl.quant import native, mxfp4; print(native.kernels());"
            "x = torch.randn(4, 64); b, s = mxfp4.quantize(x); out = torch.empty(4, 64); mxfp4.dequantize_(b, s, out);"
            "print(bool(((out - x).abs() <= mxfp4.abs_error_bound(x, s)).all()))")
    env = {**os.environ, "HYBRIDRL_CACHE_DIR": str(tmp_path), "CC": "", "PATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None", "True"]
