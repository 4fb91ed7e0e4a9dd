"""Lazy public names for a package: ``import hybridrl`` (and its subpackages) stays fast and
GPU-free, and a name's module is imported on first use (PEP 562 module ``__getattr__``)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, names_by_module: dict[str, list[str]]) -> tuple[Callable[[str], Any], list[str]]:
    """``(__getattr__, __all__)`` for ``package``: each name resolves from its module."""
    module_of = {name: module for module, names in names_by_module.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name in module_of:
            return getattr(importlib.import_module(module_of[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__, sorted(module_of)
