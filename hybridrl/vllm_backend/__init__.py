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

from hybridrl.lazy_exports import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "hybridrl.vllm_backend.engine": ["VllmEngine"],
    "hybridrl.vllm_backend._import": ["VllmUnavailableError", "vllm_available", "INSTALL_HINT"],
})
