"""Build a run from a :class:`Config`: data, the typed components, the step, the logs.

Each component builds itself from the run's config in one call (``Actor.from_config``,
``Critic.from_config``, ``RolloutWorker.from_config``, ``BatchShape.from_config``); no
attribute of a component is set from outside after construction.
"""

from __future__ import annotations

import os
import random
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hybridrl.config import Config, DataConfig
from hybridrl.distributed.context import DistContext
from hybridrl.pipeline.engines import adapter_spec, build_engine
from hybridrl.job.metrics_log import MetricsLog
from hybridrl.trainer.prompts import PromptSet
from hybridrl.trainer.rl_step import BatchShape, RLStep
from hybridrl.job.run_dir import RunDir, open_run_dir

if typing.TYPE_CHECKING:
    from hybridrl.job.demonstrations import TeacherDemos

Console = Callable[[str], None]


@dataclass
class Run:
    """What the loop drives: the step (which owns the components), data, outputs."""

    cfg: Config
    run_dir: Path
    directory: RunDir  # the lock and where the run resumes from
    tokenizer: PreTrainedTokenizerBase
    step: RLStep
    eval_set: PromptSet
    # (prompts, answers, slips) for the warm start; slips[i]: the teacher's carry slip or None
    sft_pairs: tuple[list[list[int]], list[list[int]], list[list[int] | None]] | None
    log: MetricsLog
    console: Console
    # the agent task's warm start instead: multi-turn demonstrations (job/demonstrations.py)
    sft_demos: "TeacherDemos | None" = None

    @property
    def policy(self) -> PreTrainedModel:
        return self.step.actor.model

    @property
    def lora(self):
        """The policy's ``LoRAPolicy`` when it trains LoRA adapters (``model.lora.rank > 0``), else None."""
        return self.step.rollout.lora

    def describe_model(self) -> str:
        n = sum(p.numel() for p in self.policy.parameters())
        c = self.policy.config
        text = f"{c.model_type}, {n / 1e6:.2f}M params, {c.num_hidden_layers} layers, hidden {c.hidden_size}"
        return text if self.lora is None else f"{text}, {self.lora.describe()}"


def build_run(cfg: Config, console: Console | None = None, dp: DistContext | None = None) -> Run:
    """Data, model, reward, run directory (locked), then the components (``_step``).

    ``dp``: this rank of a data-parallel job; every rank builds the same model and data
    (same seeds) and its own engine; only rank 0 owns the run directory and its logs."""
    from hybridrl.rewards import RewardRunner
    from hybridrl.checkpoint.train_state import checkpoint_step
    from hybridrl.job.model_factory import DTYPES, builtin_model, builtin_tokenizer, load_pretrained

    main = dp is None or dp.is_main
    if console is None:
        from tqdm.auto import tqdm

        console = tqdm.write if main else (lambda line: None)  # tqdm.write prints above an active bar
    t, m = cfg.trainer, cfg.model
    if t.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.device={t.device}: this torch build sees no CUDA device "
                         f"(torch {torch.__version__}); use trainer.device=cpu or install a CUDA build of torch")
    if t.threads > 0:
        torch.set_num_threads(t.threads)
    else:  # 0 = all cores this process may run on (ranks on one host share them), whatever ran before
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1") if dp is not None else 1)))
    torch.manual_seed(t.seed)
    dtype = DTYPES[m.dtype]
    agent_task = cfg.data.task == "calculator" and not cfg.data.train_files
    if m.path:
        model, tokenizer = load_pretrained(m.path, dtype)
    elif agent_task:  # chat markers as tokens, a chat template with tools; positions for a whole episode
        from hybridrl.data.chat_tokenizer import build_chat_char_tokenizer

        tokenizer = build_chat_char_tokenizer()
        model = builtin_model(tokenizer, m, seed=t.seed, max_position_embeddings=max(128, cfg.env.context_tokens))
    else:
        tokenizer = builtin_tokenizer()
        model = builtin_model(tokenizer, m, seed=t.seed)
    device = dp.device if dp is not None else torch.device(t.device)
    model.to(device)
    sft = demos = None
    if cfg.data.train_files:
        train_set, eval_set = _file_data(cfg, tokenizer, console)
    elif agent_task:
        from hybridrl.job.agent_data import calculator_data

        train_set, eval_set, demos = calculator_data(cfg, tokenizer)
    else:
        train_set, eval_set, sft = _arithmetic_data(cfg, tokenizer)
    if len(train_set) < cfg.batch.prompts_per_step:
        raise ValueError(f"batch.prompts_per_step={cfg.batch.prompts_per_step} exceeds the {len(train_set)} usable "
                         "training prompts; lower batch.prompts_per_step or add data")
    runner = RewardRunner.from_config(cfg.reward, report=console)
    try:
        directory = _open_dir(cfg, dp)
    except BaseException:
        runner.close()
        raise
    try:
        longest = max(len(p) for p in train_set.prompts + eval_set.prompts)  # the engine serves both
        step = _step(cfg, model, tokenizer, runner, train_set, longest, device, dp)
        if cfg.trainer.mode != "sync":
            step.pipeline = build_pipeline(cfg, model.config, step, longest_prompt=longest, device=device,
                                           console=console)
        resume_after = checkpoint_step(directory.resume_from) if directory.resume_from is not None else None
        log = MetricsLog(directory.path, tensorboard=cfg.logging.tensorboard, resume_after=resume_after,
                         write=dp is None or dp.is_main)
        return Run(cfg=cfg, run_dir=directory.path, directory=directory, tokenizer=tokenizer, step=step,
                   eval_set=eval_set, sft_pairs=sft, log=log, console=console, sft_demos=demos)
    except BaseException:
        directory.close()
        runner.close()
        raise


def _open_dir(cfg: Config, dp: DistContext | None) -> RunDir:
    """Rank 0 opens (and locks) the run directory; with several ranks it tells the others
    whether the run resumes, so every rank takes the same path (or raises the same error)."""
    t = cfg.trainer
    if dp is None:
        return open_run_dir(t.output_dir, t.run_name, cfg.checkpoint.resume)
    import torch.distributed as dist

    directory, error = None, None
    if dp.is_main:
        try:
            directory = open_run_dir(t.output_dir, t.run_name, cfg.checkpoint.resume)
        except ValueError as e:
            error = str(e)
    box = [error, None if directory is None else directory.resume_from]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ValueError(box[0])
    return directory if directory is not None else RunDir(Path(t.output_dir).resolve() / t.run_name, box[1], -1)


def _step(cfg: Config, model, tokenizer, runner, train_set: PromptSet, longest_prompt: int, device: torch.device,
          dp: DistContext | None) -> RLStep:
    """The components, each built from the run's config in one call, and the step over them."""
    from hybridrl.trainer.actor import Actor
    from hybridrl.trainer.critic import Critic
    from hybridrl.trainer.rollout_worker import RolloutWorker
    from hybridrl.trainer.scoring import RewardScorer

    mesh = None
    if cfg.rollout.tensor_parallel_size > 1:
        from hybridrl.distributed.mesh import build_rollout_mesh
        from hybridrl.rollout.layers.tensor_parallel import check_tensor_parallel

        check_tensor_parallel(model.config, cfg.rollout.tensor_parallel_size, cfg.rollout.quantization)
        mesh = build_rollout_mesh(cfg.rollout.tensor_parallel_size)
    lora = None
    if cfg.model.lora.enabled:  # peft adapters; the trainer works on the HF model inside (lora/policy.py)
        from hybridrl.lora import apply_lora

        spec = cfg.model.lora
        lora = apply_lora(model, rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout,
                          target_modules=spec.target_modules, init=spec.init)
        model = lora.model
    engine = build_engine(cfg, model.config, device=device, ranks=dp.world_size if dp is not None else 1,
                          longest_prompt=longest_prompt, tensor_parallel=mesh.tp if mesh is not None else None,
                          lora=lora, policy=model)
    actor = Actor.from_config(model, cfg)
    rollout = RolloutWorker.from_config(engine, cfg.rollout, cfg.refit, eos_token_id=tokenizer.eos_token_id,
                                        device=device, mesh=mesh, lora=lora)
    rollout.refit(model)  # first load = the refit path
    critic = Critic.from_config(cfg, model.config, device) if cfg.algo.advantage.estimator == "gae" else None
    step = RLStep(rollout=rollout, scorer=RewardScorer(runner, tokenizer), actor=actor, critic=critic,
                  train_set=train_set, algo=cfg.algo, shape=BatchShape.from_config(cfg, tokenizer.pad_token_id or 0),
                  dp=dp)
    step.exact_recompute = cfg.rollout.exact_recompute
    step.mismatch_report_every = cfg.trainer.mismatch_report_every
    if cfg.env.name is not None:
        step.episodes = build_episode_sampler(cfg, engine, tokenizer, step.scorer, rollout.sampling)
    return step


def build_pipeline(cfg: Config, hf_config, step: RLStep, *, longest_prompt: int, device: torch.device,
                   console: Console):
    """``trainer.mode`` one_step_off / async: the pipeline of rollout workers
    (``pipeline.*``), each with its own engine built like the run's; not started yet
    (``RLStep.start_pipeline`` does, after the warm start or the resume)."""
    from hybridrl.pipeline.coordinator import Pipeline
    from hybridrl.pipeline.producers import LocalProducer, RemoteProducer
    from hybridrl.pipeline.worker import WorkerSpec
    from hybridrl.trainer.rollout_worker import RolloutWorker

    p, t = cfg.pipeline, cfg.trainer
    lora = step.rollout.lora  # LoRA: every producer's refits send the adapters (or merged targets)
    if p.placement == "colocated":
        def make_producer(i, sink, wake):
            engine = build_engine(cfg, hf_config, device=device, ranks=1, longest_prompt=longest_prompt, lora=lora)
            worker = RolloutWorker(engine, step.rollout.sampling, device=device,
                                   bucket_bytes=cfg.refit.bucket_mb << 20, verify_refit=cfg.refit.verify,
                                   lora=lora, lora_mode=cfg.rollout.lora_mode)
            return LocalProducer(i, worker, sink, wake, step_latency_s=cfg.rollout.step_latency_ms / 1000)
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        share = max(1, cores // (p.workers + 1))  # the cores this process may run on, split evenly
        threads = p.worker_threads or t.threads or share
        if t.threads == 0:
            torch.set_num_threads(share)
        spec = WorkerSpec(cfg=cfg, hf_config=hf_config, device=str(device), longest_prompt=longest_prompt,
                          threads=threads, step_latency_s=cfg.rollout.step_latency_ms / 1000, verify=cfg.refit.verify,
                          timeout_s=p.timeout_s, adapter=adapter_spec(lora, cfg.rollout.lora_mode))

        if cfg.launcher.name == "ray":  # rollout workers as Ray actors, placed by Ray (weights: object store)
            from hybridrl.pipeline.ray_producer import RayProducer

            def make_producer(i, sink, wake):
                return RayProducer(i, spec, sink, wake, cpus=threads, gpus=1 if device.type == "cuda" else 0,
                                   lora=lora)
        else:
            def make_producer(i, sink, wake):
                return RemoteProducer(i, spec, sink, wake, bucket_bytes=cfg.refit.bucket_mb << 20, lora=lora)
    one_step_off = t.mode == "one_step_off"
    placement = ("a thread of the trainer process" if p.placement == "colocated" else
                 "Ray actors" if cfg.launcher.name == "ray" else "processes (weights by shared memory)")
    return Pipeline(placement=placement, make_producer=make_producer, workers=p.workers, train_set=step.train_set,
                    score=step.scorer.score, sampling=step.rollout.sampling,
                    prompts_per_step=cfg.batch.prompts_per_step, max_staleness=1 if one_step_off else p.max_staleness,
                    partial=not one_step_off, timeout_s=p.timeout_s, restarts=p.worker_restarts,
                    pad_id=step.shape.pad_id, device=device, console=console)


def build_episode_sampler(cfg: Config, engine, tokenizer, scorer, sampling):
    """``env.*``: the environment pool, the chat renderer (checked: the template must render a
    conversation as its turns appended) and the episode runner on the run's engine."""
    from hybridrl.agents.chat_render import ChatRenderer, check_template
    from hybridrl.agents.env_pool import EnvPool
    from hybridrl.agents.episodes import EpisodeLimits, EpisodeRunner
    from hybridrl.trainer.episode_sampler import EpisodeSampler

    e = cfg.env
    pool = EnvPool(e.name, workers=e.workers, timeout_s=e.timeout_s, memory_limit_mb=e.memory_limit_mb,
                   max_tool_calls=e.max_tool_calls, parser=e.parser, system_prompt=e.system_prompt)
    renderer = ChatRenderer(tokenizer, pool.schemas)
    check_template(renderer, name=f"the tokenizer's ({cfg.model.path or 'built-in'})")
    limits = EpisodeLimits(max_turns=e.max_turns, tool_response_tokens=e.tool_response_tokens,
                           context_tokens=e.context_tokens)
    runner = EpisodeRunner(engine, pool, renderer, tokenizer, sampling, limits)
    return EpisodeSampler(runner, scorer, scores_final_answer=pool.kind == "tools", discount=e.discount,
                          failure_reward=cfg.reward.failure_reward)


def _arithmetic_data(cfg: Config, tokenizer) -> tuple[PromptSet, PromptSet, tuple]:
    from hybridrl.data.arithmetic import arithmetic_splits
    from hybridrl.data.char_tokenizer import encode_prompt

    d = cfg.data
    train, ev = arithmetic_splits(num_digits=d.num_digits, operations=d.operations, train_size=d.train_size,
                                  eval_size=d.eval_size, seed=d.seed)

    def to_set(exs):
        return PromptSet([encode_prompt(tokenizer, e.prompt) for e in exs], [e.answer for e in exs],
                         [e.prompt for e in exs])

    def answer_ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    tr = to_set(train)
    sft = (tr.prompts, [answer_ids(a) for a in tr.answers], [None if e.slip is None else answer_ids(e.slip) for e in train])
    return tr, to_set(ev), sft


def prompt_set_from_files(files: list[str], tokenizer, data: DataConfig, console: Console) -> PromptSet:
    """Prompts (jsonl, parquet or a ``datasets`` directory) with the skip report printed."""
    from hybridrl.data.files import load_prompt_files

    recs, report = load_prompt_files(files, tokenizer, prompt_key=data.prompt_key, answer_key=data.answer_key,
                                     max_prompt_length=data.max_prompt_length, system_prompt=data.system_prompt)
    console(f"data {', '.join(files)}: {report.summary()}")
    return PromptSet([r.prompt_ids for r in recs], [r.answer for r in recs],
                     [tokenizer.decode(r.prompt_ids, skip_special_tokens=True) for r in recs])


def _file_data(cfg: Config, tokenizer, console: Console) -> tuple[PromptSet, PromptSet]:
    d = cfg.data
    train = prompt_set_from_files(d.train_files, tokenizer, d, console)
    if not train.prompts:
        raise ValueError(f"data.train_files {d.train_files}: no usable prompts (see the skip counts above)")
    if d.val_files:
        return train, prompt_set_from_files(d.val_files, tokenizer, d, console)
    rng = random.Random(d.seed)
    order = list(range(len(train.prompts)))
    rng.shuffle(order)
    n_eval = min(d.eval_size, max(1, len(order) // 20))
    ev_idx, tr_idx = order[:n_eval], order[n_eval:] or order
    return train.subset(tr_idx), train.subset(ev_idx)
