"""The run's rollout engine from its config: one function, used by the trainer process
and by every rollout worker (a process or Ray actor of an overlapped run), so all of them
build the same engine."""

from __future__ import annotations

import torch

from hybridrl.config import Config


def build_engine(cfg: Config, hf_config, *, device: torch.device, ranks: int, longest_prompt: int,
                 tensor_parallel=None, lora=None, policy=None):
    """The run's rollout engine (``rollout.backend``), sized for this rank's share of a
    step's responses (a tensor-parallel group's: its ranks' shares) and the longest prompt
    plus ``rollout.max_tokens``. ``tensor_parallel``: this rank's place in its group.
    ``lora``: the policy's ``LoRAPolicy``; with ``rollout.lora_mode=adapter`` the engine is
    built to apply its adapters (merged mode needs nothing of the engine). ``policy``: the
    trainer's module, which ``rollout.exact`` samples with (``hybridrl/exact/engine.py``)."""
    from hybridrl.rollout import EngineSpec
    from hybridrl.rollout.layers.tensor_parallel import SINGLE

    tensor_parallel = tensor_parallel or SINGLE
    r, t = cfg.rollout, cfg.trainer
    spec = EngineSpec(max_batch_size=min(cfg.batch.prompts_per_step * r.n // ranks * tensor_parallel.size, 256),
                      max_seq_len=cfg.env.context_tokens if cfg.env.name else longest_prompt + r.max_tokens, dtype=cfg.model.torch_dtype, device=device,
                      quantization=r.quantization, lora=adapter_spec(lora, r.lora_mode))
    if r.exact:
        from hybridrl.exact.engine import ExactEngine

        if policy is None:
            raise ValueError("rollout.exact samples with the trainer's own modules: pass policy= to build_engine")
        return ExactEngine(policy, max_batch_size=spec.max_batch_size, max_seq_len=spec.max_seq_len,
                           pad_token_id=getattr(hf_config, "pad_token_id", None) or 0)
    if r.backend == "vllm":
        from hybridrl.vllm_backend import VllmEngine

        return VllmEngine(hf_config, spec, seed=t.seed, enforce_eager=r.enforce_eager,
                          free_cache_engine=r.free_cache_engine, kv_on_refit=r.kv_on_refit,
                          tensor_parallel=tensor_parallel if tensor_parallel.size > 1 else None)
    from hybridrl.rollout import RolloutEngine

    return RolloutEngine(hf_config, spec, enforce_eager=r.enforce_eager, record_routing=r.routing_replay,
                         kv_on_refit=r.kv_on_refit, max_prefill_tokens=r.max_prefill_tokens,
                         prefix_cache_bytes=r.prefix_cache_mb << 20, tensor_parallel=tensor_parallel)


def adapter_spec(lora, mode: str):
    """The ``AdapterSpec`` an engine applies in ``rollout.lora_mode=adapter`` (None in merged
    mode or without LoRA). ``lora``: a ``LoRAPolicy``, or already an ``AdapterSpec`` (what a
    rollout worker process is sent)."""
    from hybridrl.rollout.layers.lora_adapter import AdapterSpec

    if lora is None or mode != "adapter":
        return None
    if isinstance(lora, AdapterSpec):
        return lora
    return AdapterSpec(rank=lora.rank, scale=lora.scale, modules=tuple(lora.targets))
