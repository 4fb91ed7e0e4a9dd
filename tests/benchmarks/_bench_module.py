"""Import a script from ``benchmarks/`` as a module (it is not a package), with the folder
on ``sys.path`` only while it loads so its ``from _common import ...`` resolves; registered
in ``sys.modules`` as ``bench_<name>``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load_bench(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses (and pickling) look the module up by name
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


# In-process vLLM leaves torch state behind (custom-op registrations, threads): on an
# AVX-512 machine a later torch.compile'd decode in the same pytest process aborted with
# "free(): invalid pointer" (tests/rollout/test_numerics.py::test_compiled_decode_matches_eager
# after test_vllm_rows; reproduced with the code of 04064f3 too). Tests that start vLLM
# in-process therefore run their body in a fresh interpreter.
IN_FRESH_PROCESS = "HYBRIDRL_TEST_IN_FRESH_PROCESS"


def in_fresh_process(nodeid: str) -> bool:
    """Run test ``nodeid`` in a new pytest process and assert it passed; returns False
    when already inside that process (the caller then runs the body)."""
    import os
    import subprocess

    if os.environ.get(IN_FRESH_PROCESS):
        return False
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid], cwd=root,
                          env=dict(os.environ, **{IN_FRESH_PROCESS: "1"}), capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, f"{nodeid} in a fresh process:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    return True
