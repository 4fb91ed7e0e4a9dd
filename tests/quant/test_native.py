"""The fused CPU FP8 kernels (hybridrl/quant/fp8_kernels.c) against torch, bit for bit.

The torch path of hybridrl.quant.fp8 is the reference: every test runs both and demands
identical bytes (scales, fp8 codes, dequantized values), on fresh random data with a wide
dynamic range, odd shapes, strided rows and both source / output dtypes.
"""
import os
import stat
import subprocess
import sys

import pytest
import torch

from hybridrl.quant import fp8, native

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def lib():
    lib = native.kernels()
    assert lib is not None, "a C compiler is present, so the FP8 kernels must build"
    return lib


@pytest.fixture
def torch_path(monkeypatch):
    """Call ``fn(*args)`` with the native kernels switched off."""
    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(native, "kernels", lambda: None)
            return fn(*args, **kwargs)
    return run


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def test_fp8_to_float32_all_256_codes(lib):
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256)
    lib.hrl_e4m3fn_to_f32(codes.data_ptr(), out.data_ptr(), 256)
    assert torch.equal(_bits(out), _bits(codes.view(fp8.FP8_DTYPE).float()))


def test_float32_to_fp8_matches_torch_cast(lib):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    n = 1 << 20
    magnitudes = torch.exp2(torch.randint(-24, 12, (n,), generator=g).float())  # subnormals .. saturation
    x = torch.randn(n, generator=g) * magnitudes
    # Exact ties at every spacing (round-to-even decides), boundaries and specials.
    ties = (torch.arange(1, 512, dtype=torch.float32) + 0.5) * 2.0**-9
    specials = torch.tensor([0.0, -0.0, 2**-6, 2**-7, 2**-10, 2**-11, 448.0, 456.0, 464.0, 479.0, 480.0, 1e30,
                             float("inf"), -float("inf"), float("nan"), -float("nan"), 1e-45, -3e-42])
    x = torch.cat([x, ties, -ties * 64, specials])
    out = torch.empty(x.shape, dtype=torch.uint8)
    lib.hrl_f32_to_e4m3fn(x.data_ptr(), out.data_ptr(), x.numel())
    want = _bits(x.to(fp8.FP8_DTYPE))
    bad = (out != want).nonzero().flatten()
    assert len(bad) == 0, f"{len(bad)} mismatches, e.g. {x[bad[:4]].tolist()} -> {out[bad[:4]].tolist()} vs {want[bad[:4]].tolist()}"


def test_float32_to_bf16_matches_torch_and_keeps_nan(lib):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    x = torch.randn(1 << 18, generator=g) * torch.exp2(torch.randint(-130, 120, (1 << 18,), generator=g).float())
    x[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    out = torch.empty(x.shape, dtype=torch.int16)
    lib.hrl_f32_to_bf16(x.data_ptr(), out.data_ptr(), x.numel())
    assert out.view(torch.bfloat16)[0].isnan()
    assert torch.equal(out[1:], _bits(x[1:].to(torch.bfloat16)))


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("shape", [(1, 5), (7, 300), (128, 128), (130, 257), (384, 1000)])
def test_quantize_dequantize_equal_torch_path(lib, torch_path, src_dtype, block, shape):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    n, k = shape
    src = (torch.randn(n, k + 3, generator=g) * torch.exp2(torch.randint(-12, 12, (n, 1), generator=g).float()))
    src[0, :2] = 0.0
    src = src.to(src_dtype)[:, 1:k + 1]  # rows strided (row stride k + 3), column stride 1
    scale_shape = fp8.block_scale_shape(n, k) if block else (n, 1)
    ours = (torch.empty(n, k, dtype=fp8.FP8_DTYPE), torch.empty(scale_shape))
    ref = (torch.empty(n, k, dtype=fp8.FP8_DTYPE), torch.empty(scale_shape))
    fp8.quantize_(src, *ours, block=block)
    torch_path(fp8.quantize_, src, *ref, block=block)
    assert torch.equal(_bits(ours[0]), _bits(ref[0]))
    assert torch.equal(ours[1], ref[1])
    for out_dtype in (torch.float32, torch.bfloat16):
        a, b = torch.empty(n, k + 2, dtype=out_dtype)[:, :k], torch.empty(n, k, dtype=out_dtype)
        fp8.dequantize_(*ours, a)
        torch_path(fp8.dequantize_, *ours, b)
        assert torch.equal(_bits(a.contiguous()), _bits(b))


def test_thread_split_gives_the_same_bytes(lib):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    src = torch.randn(1030, 700, generator=g).to(torch.bfloat16)
    results = []
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2, 3):
            torch.set_num_threads(n_threads)
            w, s = torch.empty(src.shape, dtype=fp8.FP8_DTYPE), torch.empty(1030, 1)
            fp8.quantize_(src, w, s, block=False)
            out = torch.empty(src.shape, dtype=torch.bfloat16)
            fp8.dequantize_(w, s, out)
            results.append((_bits(w).clone(), s.clone(), _bits(out).clone()))
    finally:
        torch.set_num_threads(threads)
    for r in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], r))


def _child(code: str, env: dict) -> str:
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_build_is_cached_and_can_be_switched_off(tmp_path):
    code = "from hybridrl.quant import native; k = native.kernels(); print(k._name if k else None)"
    first = _child(code, {"HYBRIDRL_CACHE_DIR": str(tmp_path)})
    assert first.startswith(str(tmp_path)) and os.path.exists(first)
    stamp = os.stat(first).st_mtime_ns
    assert _child(code, {"HYBRIDRL_CACHE_DIR": str(tmp_path)}) == first  # loaded, not rebuilt
    assert os.stat(first).st_mtime_ns == stamp
    assert [p.suffix for p in (tmp_path / "kernels").iterdir()] == [".so"]  # no temp files left
    assert _child(code, {"HYBRIDRL_CACHE_DIR": str(tmp_path), "HYBRIDRL_NATIVE_KERNELS": "0"}) == "None"


def test_missing_compiler_falls_back_to_torch(tmp_path):
    code = ("import torch; from hybridrl.quant import native, fp8; print(native.kernels());"
            "w = torch.empty(4, 8, dtype=fp8.FP8_DTYPE); s = torch.empty(4, 1);"
            "fp8.quantize_(torch.randn(4, 8), w, s, block=False); print(bool(torch.isfinite(s).all()))")
    env = {"HYBRIDRL_CACHE_DIR": str(tmp_path), "CC": "", "PATH": str(tmp_path)}
    assert _child(code, env).split() == ["None", "True"]


def test_corrupt_cached_library_is_rebuilt(tmp_path):
    code = "from hybridrl.quant import native; k = native.kernels(); print(k._name if k else None)"
    path = _child(code, {"HYBRIDRL_CACHE_DIR": str(tmp_path)})
    with open(path, "wb") as f:
        f.write(b"not an ELF file")
    assert _child(code, {"HYBRIDRL_CACHE_DIR": str(tmp_path)}) == path
    assert os.path.getsize(path) > 1000


@pytest.mark.parametrize("block", [False, True])
def test_nan_rows_and_tiles_match_torch_path(lib, torch_path, block):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    src = torch.randn(260, 300, generator=g)
    src[3, 17] = float("nan")  # one row (per channel) / one tile (block) turns NaN, as in torch
    scale_shape = fp8.block_scale_shape(260, 300) if block else (260, 1)
    ours = (torch.empty(260, 300, dtype=fp8.FP8_DTYPE), torch.empty(scale_shape))
    ref = (torch.empty(260, 300, dtype=fp8.FP8_DTYPE), torch.empty(scale_shape))
    fp8.quantize_(src, *ours, block=block)
    torch_path(fp8.quantize_, src, *ref, block=block)
    assert ours[1].isnan().any()
    torch.testing.assert_close(ours[1], ref[1], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(_bits(ours[0]), _bits(ref[0]))


def test_bad_scale_shape_is_an_error_not_an_out_of_bounds_read():
    w = torch.ones(2, 256).to(fp8.FP8_DTYPE)
    with pytest.raises(ValueError, match="scale has shape"):
        fp8.dequantize_(w, torch.tensor([1.0, 1000.0])[:1].view(1, 1), torch.empty(2, 256))
    with pytest.raises(ValueError, match="scale has shape"):
        fp8.quantize_(torch.randn(2, 256), w, torch.empty(1, 1), block=False)


def test_kernels_never_see_non_cpu_or_overlapping_tensors():
    # A CPU source into a non-CPU weight (the first load of a CUDA engine) must take the
    # torch path (a cross-device copy), not hand device pointers to C. "meta" stands in here.
    w, s = torch.empty(4, 64, dtype=fp8.FP8_DTYPE, device="meta"), torch.empty(4, 1, device="meta")
    fp8.quantize_(torch.randn(4, 64), w, s, block=False)
    # A broadcast output (row stride 0) is refused by torch's copy_, not silently written.
    q, scale = torch.empty(4, 64, dtype=fp8.FP8_DTYPE), torch.empty(4, 1)
    fp8.quantize_(torch.randn(4, 64), q, scale, block=False)
    with pytest.raises(RuntimeError):
        fp8.dequantize_(q, scale, torch.empty(1, 64).expand(4, 64))


def test_forked_child_does_not_hang(lib, tmp_path):
    code = """
import os, sys, time, torch
from hybridrl.quant import fp8
torch.set_num_threads(2)
src = torch.randn(4096, 1024)  # large enough to split across threads
w, s = torch.empty(src.shape, dtype=fp8.FP8_DTYPE), torch.empty(4096, 1)
fp8.quantize_(src, w, s, block=False)  # parent: the thread pool now exists
pid = os.fork()
if pid == 0:
    fp8.quantize_(src, w, s, block=False)
    os._exit(0)
deadline = time.time() + 60
while time.time() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
sys.exit(3)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-1000:])


_LOAD = ("import logging; logging.basicConfig(level=logging.WARNING); from hybridrl.quant import native; "
         "k = native.kernels(); print(k._name if k else None, hasattr(k, 'planted_marker'), "
         "hasattr(k, 'hrl_quantize_channel'))")


def _plant(path: str, tmp_path) -> None:
    """Replace the cached library with a valid one that is not ours to trust."""
    src = tmp_path / "planted.c"
    src.write_text("int planted_marker(void) { return 42; }\n")
    subprocess.run([native._compiler(), "-shared", "-fPIC", str(src), "-o", path], check=True)


def _load_in_child(cache: str) -> tuple[str, bool, bool, str]:
    proc = subprocess.run([sys.executable, "-c", _LOAD], env={**os.environ, "HYBRIDRL_CACHE_DIR": cache},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    name, planted, real = proc.stdout.split()
    return name, planted == "True", real == "True", proc.stderr


def test_new_cache_folders_are_private(tmp_path):
    cache = tmp_path / "new" / "deeper"
    name, _, real, _ = _load_in_child(str(cache))
    assert real and name.startswith(str(cache))
    for folder in (tmp_path / "new", cache, cache / "kernels"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_world_writable_cached_library_is_rebuilt_not_loaded(tmp_path):
    path, _, _, _ = _load_in_child(str(tmp_path))
    _plant(path, tmp_path)
    os.chmod(path, 0o777)
    name, planted, real, _ = _load_in_child(str(tmp_path))
    assert name == path and real and not planted
    assert not os.stat(path).st_mode & 0o022  # rebuilt in place, in the private folder


@pytest.mark.skipif(os.getuid() != 0, reason="making a file owned by another user needs root")
def test_cached_library_owned_by_another_user_is_rebuilt(tmp_path):
    path, _, _, _ = _load_in_child(str(tmp_path))
    _plant(path, tmp_path)
    os.chown(path, 65534, -1)
    name, planted, real, _ = _load_in_child(str(tmp_path))
    assert name == path and real and not planted and os.stat(path).st_uid == os.getuid()


def test_cache_folder_writable_by_others_is_not_used(tmp_path):
    path, _, _, _ = _load_in_child(str(tmp_path))
    _plant(path, tmp_path)
    os.chmod(os.path.dirname(path), 0o777)
    before = open(path, "rb").read()
    name, planted, real, err = _load_in_child(str(tmp_path))
    assert real and not planted and name != path  # built in a private temporary folder instead
    assert "not private" in err
    assert open(path, "rb").read() == before  # nothing written into the open folder
