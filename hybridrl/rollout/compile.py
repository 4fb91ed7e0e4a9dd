"""``torch.compile`` for the engine, with inductor's on-disk cache kept per CPU capability.

Inductor caches compiled CPU kernels under ``TORCHINDUCTOR_CACHE_DIR`` (default
``/tmp/torchinductor_<user>``), and the cache did not tell kernels apart by the ATen CPU
capability that picked their vector ISA: on an AVX-512 host, a kernel compiled under
``ATEN_CPU_CAPABILITY=avx2`` and loaded by a later default run (or the reverse) computed wrong
values — the compiled decode sampled other tokens than eager — or crashed the process ("double
free or corruption"); measured with torch 2.13.0. So, unless the user chose a cache directory,
the engine keeps one per capability (``<default>_avx2``, ``<default>_avx512``, ...).
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def keyed_inductor_cache() -> str | None:
    """Point inductor's cache at this capability's directory unless the user chose one; the
    directory in use, or None if the user's. (Inductor writes its default into the variable
    the first time anything asks for the directory, so the default value is not a choice.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    if os.environ.get(CACHE_ENV, default) != default:
        return None
    os.environ[CACHE_ENV] = f"{default}_{torch.backends.cpu.get_cpu_capability().lower()}"
    return os.environ[CACHE_ENV]


def compile_fn(fn: Callable, **kwargs) -> Callable:
    """``torch.compile(fn, **kwargs)`` with the cache keyed by capability."""
    keyed_inductor_cache()
    return torch.compile(fn, **kwargs)
