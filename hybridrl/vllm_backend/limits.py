"""What the vLLM backend cannot serve, one line each with the reason: checked by the run's
engine factory (``pipeline/engines.py::check_engine_choice``) before anything is built."""

from __future__ import annotations

from hybridrl.config import Config
from hybridrl.config.base import ConfigError


def check_vllm_run(cfg: Config) -> None:
    r, ranks = cfg.rollout, cfg.launcher.ranks
    if r.backend != "vllm":
        return
    if r.quantization and cfg.model.dtype != "bfloat16":
        raise ConfigError(f"rollout.quantization={r.quantization} with rollout.backend=vllm needs "
                          "model.dtype=bfloat16 (vLLM's online FP8 runs bf16 activations)")
    if ranks > 1 and r.tensor_parallel_size != ranks:
        raise ConfigError(f"rollout.backend=vllm on {ranks} ranks runs one vLLM engine over all of them "
                          "(vLLM's external_launcher, a shard per rank): set rollout.tensor_parallel_size="
                          f"{ranks}, or use rollout.backend=builtin for data-parallel generation groups")
    if not cfg.model.lora.enabled:
        return
    if r.lora_mode == "adapter" and r.kv_on_refit != "recompute":
        raise ConfigError(f"model.lora with rollout.backend=vllm, rollout.lora_mode=adapter and "
                          f"rollout.kv_on_refit={r.kv_on_refit}: requests kept across a refit would hold the "
                          "removed adapter; use rollout.kv_on_refit=recompute or rollout.lora_mode=merged")
    if r.lora_mode == "merged":
        targets = set(cfg.model.lora.target_modules)
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            if targets & set(group) and not set(group) <= targets:
                raise ConfigError(f"model.lora.target_modules={sorted(targets)} with rollout.backend=vllm splits "
                                  f"vLLM's fused {'/'.join(group)} layer (it reloads a fused layer from all its "
                                  f"shards); target all of {', '.join(group)} or none")
