"""The engine keeps inductor's compiled-kernel cache per CPU capability (``rollout/compile.py``):
kernels cached under one ``ATEN_CPU_CAPABILITY`` and loaded under another computed wrong values
or crashed (torch 2.13.0); a user's own cache directory is left alone."""
import os

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from hybridrl.rollout.compile import CACHE_ENV, keyed_inductor_cache


def test_the_default_cache_is_keyed_by_capability_and_a_chosen_one_is_kept(monkeypatch, tmp_path):
    capability = torch.backends.cpu.get_cpu_capability().lower()
    for unset_or_default in (None, os.path.abspath(default_cache_dir())):
        if unset_or_default is None:
            monkeypatch.delenv(CACHE_ENV, raising=False)
        else:
            monkeypatch.setenv(CACHE_ENV, unset_or_default)  # inductor writes its default there
        assert keyed_inductor_cache() == os.environ[CACHE_ENV]
        assert os.environ[CACHE_ENV].endswith(f"_{capability}")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert keyed_inductor_cache() is None and os.environ[CACHE_ENV] == str(tmp_path)
