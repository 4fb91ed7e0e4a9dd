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
