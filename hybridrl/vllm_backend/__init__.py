"""vLLM as a second rollout backend (``rollout.backend=vllm``), refit through the same bracket.

    from hybridrl.rollout import EngineSpec
    from hybridrl.vllm_backend import VllmEngine

    engine = VllmEngine(hf_config, EngineSpec(max_batch_size=256, max_seq_len=64))  # in-process vLLM
    refit_from_model(engine, hf_model, verify=True)                     # version 1
    rollouts = engine.generate(prompt_token_ids, SamplingParams(...))

vLLM is an optional dependency (``pip install 'hybridrl[vllm]'``); nothing here imports it
until a ``VllmEngine`` is built. See docs/vllm.md.
"""

from __future__ import annotations

__all__ = ["VllmEngine", "VllmUnavailableError", "vllm_available", "INSTALL_HINT"]

_MODULES = {
    "VllmEngine": "hybridrl.vllm_backend.engine",
    "VllmUnavailableError": "hybridrl.vllm_backend._import",
    "vllm_available": "hybridrl.vllm_backend._import",
    "INSTALL_HINT": "hybridrl.vllm_backend._import",
}


def __getattr__(name: str):
    if name in _MODULES:
        import importlib

        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'hybridrl.vllm_backend' has no attribute {name!r}")
