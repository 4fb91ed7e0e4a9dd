"""The fused CPU quantization kernels (``fp8_kernels.c``, ``mxfp4_kernels.c``): one library,
built on first use, called via ctypes.

Why native code: on CPU, torch has no fused FP8 or MXFP4 quantize/dequantize; the eager
paths in :mod:`hybridrl.quant.fp8` make four to six passes over each weight (and the fp8
casts are scalar), which kept an FP8 refit at ~6% of memcpy speed, and those of
:mod:`hybridrl.quant.mxfp4` about ten (a ``bucketize`` among them: an MXFP4 MoE refit ran
at ~2% of memcpy). These kernels do one pass and give bitwise the same result (tested
against the torch paths).

Build: the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``), no torch headers,
well under a second; the shared library is cached under ``$HYBRIDRL_CACHE_DIR`` (default
``~/.cache/hybridrl``) keyed by the source, flags and CPU, written atomically so that
concurrent processes never load a half-written file. Loading a library runs its code, so
a cached one is loaded only if it is ours and neither it nor its folder is writable by
group or others (else anyone who can write there runs code in the trainer); new cache
folders are made 0700. A foreign or writable file in a private folder is rebuilt in
place; a folder that is not private is left alone and the kernels are built in a fresh
private temporary folder for this process (warned once). Without a compiler, or with
``HYBRIDRL_NATIVE_KERNELS=0``, :func:`kernels` returns None and callers use the torch
paths (same results, slower); the reason is logged once.

Threads: ctypes releases the GIL, so rows are split across ``torch.get_num_threads()``
Python threads — no OpenMP runtime is linked next to torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f) for f in ("fp8_kernels.c", "mxfp4_kernels.c"))  # one library
FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math"]  # never -ffast-math: results must be bitwise torch's
NATIVE_FLAGS = ["-march=native"]  # dropped if the compiler rejects it
COMPILE_TIMEOUT_S = 120
MIN_ELEMENTS_PER_THREAD = 1 << 20  # measured: below ~1M elements per thread the hand-off costs more than the second core gives

_c_int64, _c_int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "hrl_quantize_channel": [_ptr, _c_int, _c_int64, _ptr, _c_int64, _ptr, _c_int64, _c_int64, _c_int64],
    "hrl_quantize_block": [_ptr, _c_int, _c_int64, _ptr, _c_int64, _ptr, _c_int64, _c_int64, _c_int64, _c_int64],
    "hrl_dequantize": [_ptr, _c_int64, _ptr, _c_int, _c_int64, _ptr, _c_int, _c_int64, _c_int64, _c_int64, _c_int64],
    "hrl_f32_to_e4m3fn": [_ptr, _ptr, _c_int64],
    "hrl_e4m3fn_to_f32": [_ptr, _ptr, _c_int64],
    "hrl_f32_to_bf16": [_ptr, _ptr, _c_int64],
    "hrl_mxfp4_quantize": [_ptr, _c_int, _c_int64, _ptr, _c_int64, _ptr, _c_int64, _c_int64, _c_int64, _c_int64],
    "hrl_mxfp4_dequantize": [_ptr, _c_int64, _ptr, _c_int64, _ptr, _c_int, _c_int64, _c_int64, _c_int64, _c_int64],
}


def _cache_dir() -> Path:
    root = os.environ.get("HYBRIDRL_CACHE_DIR") or Path.home() / ".cache" / "hybridrl"
    return Path(root) / "kernels"


def _is_private(st: os.stat_result) -> bool:
    """Ours, and no one else can write to it."""
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _private_folder(folder: Path) -> bool:
    """Make ``folder`` (and missing parents) 0700; True if it is ours and private."""
    missing = []
    for p in (folder, *folder.parents):
        if p.exists():
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:  # a concurrent process made it: checked below like any folder
            pass
    st = folder.stat()
    return stat.S_ISDIR(st.st_mode) and _is_private(st)


def _loadable(target: Path) -> bool:
    """A regular file (not a symlink) that is ours and private."""
    try:
        st = target.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and _is_private(st)


def _cpu_id() -> str:
    """What -march=native depends on: a library built for one CPU may not run on another."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build(cc: str, target: Path) -> None:
    """Compile SOURCES to ``target`` atomically (temp file in the same folder, then rename)."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for extra in (NATIVE_FLAGS, []):
            proc = subprocess.run([cc, *FLAGS, *extra, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT_S)
            if proc.returncode == 0:
                os.chmod(tmp, 0o755)  # as any shared library: readable, never writable by others
                os.replace(tmp, target)
                return
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"{cc} failed")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (torch fallback) — decided once per process."""
    if os.environ.get("HYBRIDRL_NATIVE_KERNELS", "1") == "0":
        log.info("hybridrl native quantization kernels disabled by HYBRIDRL_NATIVE_KERNELS=0; using the torch paths")
        return None
    cc = _compiler()
    if cc is None:
        log.warning("hybridrl: no C compiler found (set CC); FP8/MXFP4 quantization uses the slower torch paths")
        return None
    key = hashlib.sha256(
        b"".join(src.read_bytes() for src in SOURCES) + " ".join(FLAGS + NATIVE_FLAGS).encode() + cc.encode()
        + _cpu_id().encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"quant_kernels-{key}.so"
    try:
        lib = _load(cc, target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("hybridrl: building the FP8/MXFP4 CPU kernels failed (%s); using the slower torch paths", err)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    return lib


def _load(cc: str, target: Path) -> ctypes.CDLL:
    """The cached library at ``target`` (built or rebuilt there as needed), or, when its
    folder is not private, one built in a temporary private folder."""
    if not _private_folder(target.parent):
        log.warning("hybridrl: the kernel cache %s is not private (writable by group/others, or not yours); "
                    "building the kernels in a private temporary folder instead (chmod 700 it, or set "
                    "HYBRIDRL_CACHE_DIR to a folder of your own)", target.parent)
        with tempfile.TemporaryDirectory(prefix="hybridrl-kernels-") as folder:  # mkdtemp: 0700
            private = Path(folder) / target.name
            _build(cc, private)
            return ctypes.CDLL(str(private))  # the mapping outlives the file
    if not _loadable(target):  # missing, or planted / made writable by someone else
        _build(cc, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError:  # unloadable cached file (e.g. truncated by a full disk): rebuild once
        _build(cc, target)
        return ctypes.CDLL(str(target))


def library_for(float_tensor: torch.Tensor, *tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel library if a kernel applies to these tensors, else None (the torch path):
    ``float_tensor`` (the source or output) is float32 or bfloat16, and every tensor passes
    :func:`rows_ok`."""
    if float_tensor.dtype not in (torch.float32, torch.bfloat16) or not rows_ok(float_tensor, *tensors):
        return None
    return kernels()


def rows_ok(*tensors: torch.Tensor) -> bool:
    """The kernels read raw CPU pointers row by row: every tensor on CPU, unit column
    stride, and rows that do not overlap (a broadcast view has row stride 0)."""
    for t in tensors:
        if t.device.type != "cpu" or (t.dim() == 2 and (t.stride(1) != 1 or (t.shape[0] > 1 and t.stride(0) < t.shape[1]))):
            return False
    return True


@functools.cache
def _pool(n_threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="hybridrl-quant")


# A forked child inherits the cached pools but not their threads: it would wait forever.
os.register_at_fork(after_in_child=_pool.cache_clear)


def run_split(fn, n_units: int, unit_elements: int, call) -> None:
    """Run ``call(fn, start, stop)`` over ``[0, n_units)`` split across torch's thread count.

    ``unit_elements`` (elements per unit) decides whether threading pays at all.
    """
    n_threads = max(1, min(torch.get_num_threads(), n_units, (n_units * unit_elements) // MIN_ELEMENTS_PER_THREAD))
    if n_threads == 1:
        call(fn, 0, n_units)
        return
    bounds = [n_units * i // n_threads for i in range(n_threads + 1)]
    futures = [_pool(n_threads).submit(call, fn, a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    try:
        for f in futures:
            f.result()
    finally:
        # Even when interrupted (KeyboardInterrupt), return only once no thread is still
        # reading or writing the caller's tensors through raw pointers.
        wait(futures)
