"""The run's rollout engine from its config: one function, used by the trainer process
and by every rollout worker (a process or Ray actor of an overlapped run), so all of them
build the same engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridrl.config import Config

if TYPE_CHECKING:
    from hybridrl.rollout.core.memory import EngineMemoryError


def build_engine(cfg: Config, hf_config, *, device: torch.device, ranks: int, longest_prompt: int,
                 tensor_parallel=None, lora=None):
    """The run's rollout engine (``rollout.backend``), sized for this rank's share of a
    step's responses (a tensor-parallel group's: its ranks' shares) and the longest prompt
    plus ``rollout.max_tokens``. ``tensor_parallel``: this rank's place in its group.
    ``lora``: the policy's ``LoRAPolicy``; with ``rollout.lora_mode=adapter`` the engine is
    built to apply its adapters (merged mode needs nothing of the engine). ``rollout.exact``:
    the built-in engine with its batch-invariant layers (``rollout/exact_support.py``)."""
    from hybridrl.rollout import EngineSpec
    from hybridrl.rollout.layers.tensor_parallel import SINGLE

    tensor_parallel = tensor_parallel or SINGLE
    r, t = cfg.rollout, cfg.trainer
    max_seq_len = cfg.env.context_tokens if cfg.env.name else longest_prompt + r.max_tokens
    rows = min(cfg.batch.prompts_per_step * r.n // ranks * tensor_parallel.size, 256)
    if r.kv_cache_mb:
        rows = min(rows, _budget_rows(cfg, hf_config, max_seq_len, tensor_parallel))
    spec = EngineSpec(max_batch_size=rows, max_seq_len=max_seq_len, dtype=cfg.model.torch_dtype, device=device,
                      quantization=r.quantization, lora=adapter_spec(lora, r.lora_mode), exact=r.exact)
    if r.exact:
        _check_exact_model(hf_config, spec, tensor_parallel)
    if r.backend == "vllm":
        from hybridrl.vllm_backend import VllmEngine

        return VllmEngine(hf_config, spec, seed=t.seed, enforce_eager=r.enforce_eager,
                          free_cache_engine=r.free_cache_engine, kv_on_refit=r.kv_on_refit,
                          tensor_parallel=tensor_parallel if tensor_parallel.size > 1 else None)
    from hybridrl.rollout import RolloutEngine
    from hybridrl.rollout.core.memory import EngineMemoryError

    try:
        return RolloutEngine(hf_config, spec, enforce_eager=r.enforce_eager, record_routing=r.routing_replay,
                             kv_on_refit=r.kv_on_refit, max_prefill_tokens=r.max_prefill_tokens,
                             prefix_cache_bytes=r.prefix_cache_mb << 20, tensor_parallel=tensor_parallel)
    except EngineMemoryError as e:  # the same refusal, in the config's keys
        raise ValueError(_memory_message(cfg, e, longest_prompt)) from None


def _check_exact_model(hf_config, spec, tensor_parallel) -> None:
    """``rollout.exact`` for this model (known once its config is read: a checkpoint's may be
    any family): a one-line ConfigError where the built-in engine has no exact form of it."""
    from hybridrl.config.base import ConfigError
    from hybridrl.rollout.exact_support import exact_refusal
    from hybridrl.rollout.model_config import parse_hf_config

    why = exact_refusal(parse_hf_config(hf_config), spec, tensor_parallel)
    if why is not None:
        raise ConfigError(f"rollout.exact with a {hf_config.model_type} model: not supported ({why}); "
                          "set rollout.exact=false")


def _seq_key(cfg: Config, longest_prompt: int) -> tuple[str, int, int]:
    """(the key that sets the engine's row length, its value, the prompt tokens a row adds to it)."""
    if cfg.env.name:
        return "env.context_tokens", cfg.env.context_tokens, 0
    return "rollout.max_tokens", cfg.rollout.max_tokens, longest_prompt


def _budget_rows(cfg: Config, hf_config, max_seq_len: int, tensor_parallel) -> int:
    """The engine rows whose KV cache fits ``rollout.kv_cache_mb`` (at least one, or a ValueError)."""
    from hybridrl.rollout.core.kv_cache import rank_kv_heads
    from hybridrl.rollout.core.memory import EngineMemory, gib
    from hybridrl.rollout.model_config import parse_hf_config

    config = parse_hf_config(hf_config)
    row = EngineMemory(config=config, dtype=cfg.model.torch_dtype, weights=0,
                       kv_heads=rank_kv_heads(config, tensor_parallel)).cache_row(max_seq_len)
    mb = cfg.rollout.kv_cache_mb
    if (mb << 20) < row:
        key, value, _ = _seq_key(cfg, 0)
        least = (row + (1 << 20) - 1) >> 20
        raise ValueError(f"rollout.kv_cache_mb={mb} holds no engine row of {max_seq_len} tokens (one row's KV "
                         f"cache is {gib(row)}); raise it to at least {least} or lower {key}={value}")
    return (mb << 20) // row


def _memory_message(cfg: Config, e: EngineMemoryError, longest_prompt: int) -> str:
    """An ``EngineMemoryError`` as the one line a user acts on: the key, the bytes, the knobs."""
    key, value, prompt = _seq_key(cfg, longest_prompt)
    fixes = [f"lower {key} to at most {e.seq_len_fit - prompt}"] if e.seq_len_fit - prompt >= 1 else []
    row = e.memory.cache_row(e.seq_len)
    budget_mb = (e.rows_fit * row) >> 20
    if budget_mb and (budget_mb << 20) >= row:
        fixes.append(f"set rollout.kv_cache_mb={budget_mb} ({(budget_mb << 20) // row} rows at a time; the other "
                     "responses wait for a free row)")
    if e.rows_fit >= 1:
        fixes.append("sample fewer responses per step (batch.prompts_per_step, rollout.n)")
    todo = ", or ".join(fixes) if fixes else "not one row fits: free memory, or use a smaller model or quantization"
    return f"{key}={value}: the built-in engine's {e.rows} rows x {e.seq_len} tokens {e.needs()}; {todo}"


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


def build_runner(cfg: Config, engine, tokenizer, *, lockstep=None, leader: bool = True):
    """The work runner over ``engine`` (``work.py``): samples, and with ``env.name`` agent
    episodes (an environment pool of ``env.workers`` processes, the chat renderer checked
    once). ``lockstep``/``leader``: a tensor-parallel group's episodes (``EpisodeDriver``):
    a follower rank calls no environment, the leader's results reach it through ``lockstep``."""
    from hybridrl.pipeline.work import WorkRunner
    from hybridrl.trainer.rollout_worker import sampling_params

    latency = cfg.rollout.step_latency_ms / 1000
    if cfg.env.name is None:
        return WorkRunner(engine, step_latency_s=latency)
    pool = env_pool(cfg)
    try:
        sampling = sampling_params(cfg.rollout, tokenizer.eos_token_id, vision_ids(engine.hf_config))
        driver = episode_driver(cfg, engine, tokenizer, pool, sampling, lockstep=lockstep, leader=leader)
    except BaseException:
        pool.close()
        raise
    return WorkRunner(engine, episodes=driver, step_latency_s=latency, env_pool=pool)


def episode_driver(cfg: Config, engine, tokenizer, pool, sampling, *, lockstep=None, leader: bool = True,
                   overlap: bool | None = None):
    """The chat renderer (checked: the template must render a conversation as its turns
    appended) and the episode driver on ``engine`` with ``pool``'s environments."""
    from hybridrl.agents.chat_render import check_template
    from hybridrl.agents.episode_driver import EpisodeDriver

    renderer = chat_renderer(cfg, tokenizer, engine.hf_config, pool.schemas)
    check_template(renderer, name=f"the tokenizer's ({cfg.model.path or 'built-in'})")
    e = cfg.env
    return EpisodeDriver(engine, pool if leader else None, renderer, sampling, episode_limits(cfg),
                         overlap=e.overlap if overlap is None else overlap, env_latency_s=e.latency_ms / 1000,
                         lockstep=lockstep)


def chat_renderer(cfg: Config, tokenizer, hf_config, schemas):
    """The episodes' chat renderer; a VL policy's renders the pictures environments and tools
    send with the data set's image processor (``data.min_pixels`` / ``max_pixels``)."""
    from hybridrl.agents.chat_render import ChatRenderer, ImageStep

    prompts = vl_prompt_renderer(cfg, tokenizer, hf_config)
    return ChatRenderer(tokenizer, schemas, vision=None if prompts is None else ImageStep(prompts))


def vl_prompt_renderer(cfg: Config, tokenizer, hf_config):
    """A VL policy's prompt renderer (its chat template, and the image processor of
    ``model.path`` or the model's patch sizes, at ``data.*``'s pixel bounds): data files,
    environments and tools render pictures with it alike. None for a text model."""
    if getattr(hf_config, "vision_config", None) is None:
        return None
    from hybridrl.data.vl_prompts import VLPromptRenderer

    d = cfg.data
    return VLPromptRenderer.for_model(tokenizer, hf_config, image_key=d.image_key, min_pixels=d.min_pixels,
                                      max_pixels=d.max_pixels, max_images=d.max_images, processor_dir=cfg.model.path)


def vision_ids(hf_config) -> tuple[int, ...]:
    """A VL policy's vision special tokens (a sampled one ends its sample: ``data/vision.py``);
    () for a text model."""
    from hybridrl.data.vision import VisionTokens

    tokens = VisionTokens.of(hf_config)
    return () if tokens is None else tokens.special_ids


def env_pool(cfg: Config):
    """The environments' worker processes (``env.*``)."""
    from hybridrl.agents.env_pool import EnvPool

    e = cfg.env
    return EnvPool(e.name, workers=e.workers, timeout_s=e.timeout_s, memory_limit_mb=e.memory_limit_mb,
                   max_tool_calls=e.max_tool_calls, parser=e.parser, system_prompt=e.system_prompt)


def episode_limits(cfg: Config):
    from hybridrl.agents.episodes import EpisodeLimits

    e = cfg.env
    return EpisodeLimits(max_turns=e.max_turns, tool_response_tokens=e.tool_response_tokens,
                         context_tokens=e.context_tokens)


def check_engine_choice(cfg: Config) -> None:
    """What the chosen engine cannot serve, one line each with the reason: the vLLM backend's
    limits (``vllm_backend/limits.py``), and ``rollout.exact``'s (what no exact engine
    serves; the model-dependent limits are checked when the engine is built:
    ``_exact_fallback``). Checked before anything is built."""
    from hybridrl.config.base import ConfigError
    from hybridrl.vllm_backend.limits import check_vllm_run

    check_vllm_run(cfg)
    r = cfg.rollout
    if not r.exact:
        return
    unsupported = {
        f"rollout.backend={r.backend}": (r.backend != "builtin", "vLLM's kernels are not batch-invariant"),
        f"rollout.quantization={r.quantization}": (r.quantization is not None, "quantized rollout weights "
                                                                              "are another policy"),
        f"rollout.tensor_parallel_size={r.tensor_parallel_size}": (r.tensor_parallel_size > 1,
                                                                  "split reductions are not the trainer's"),
        "rollout.lora_mode=merged": (cfg.model.lora.enabled and r.lora_mode == "merged",
                                     "the merged W + scale * B @ A is not what peft's forward multiplies; use "
                                     "rollout.lora_mode=adapter"),
        f"model.arch={cfg.model.arch}": (cfg.model.arch == "deepseek_v4", "its compressed attention runs padded only, "
                                                                        "not through the exact attention"),
    }
    for key, (bad, why) in unsupported.items():
        if bad:
            raise ConfigError(f"rollout.exact with {key}: not supported ({why}); set rollout.exact=false or "
                              "drop that setting")


def check_vision_language(cfg: Config, hf_config) -> None:
    """What a vision-language policy (``hf_config`` has a ``vision_config``) cannot be run
    with yet, one line each with the reason; nothing for a text model. Checked once the
    model's config is known (a checkpoint's is read at build), before the engine is built."""
    if getattr(hf_config, "vision_config", None) is None:
        return
    from hybridrl.config.base import ConfigError

    unsupported = {
        "algo.advantage.estimator=gae": (cfg.algo.advantage.estimator == "gae",
                                         "the critic is a text value model; use a critic-free estimator (grpo, "
                                         "rloo, reinforce_plus_plus, ...)"),
        "algo.distill.teacher": (cfg.algo.distill.teacher is not None, "the teacher scores token ids without the "
                                                                       "images"),
    }
    for key, (bad, why) in unsupported.items():
        if bad:
            raise ConfigError(f"a vision-language policy ({hf_config.model_type}) with {key}: not supported ({why}); "
                              "drop that setting or use a text model")
