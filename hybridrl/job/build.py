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
from hybridrl.data.vision import VisionTokens
from hybridrl.distributed.context import DistContext
from hybridrl.pipeline.engines import (build_engine, chat_renderer, check_engine_choice, check_vision_language,
                                       vision_ids, vl_prompt_renderer)
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
    _eval_runner: object = None  # env.name: the eval's EpisodeRunner, built at the first eval

    def eval_episodes(self):
        """Greedy / sampled episodes for the held-out eval on the trainer's engine at the
        current version, with an environment pool of their own."""
        self.step.fresh_rollout()  # caught up to the current version
        if self._eval_runner is None:
            self._eval_runner = eval_episode_runner(self.cfg, self.step.rollout, self.tokenizer)
        return self._eval_runner

    def close_eval_episodes(self) -> None:
        if self._eval_runner is not None:
            self._eval_runner.env_pool.close()
            self._eval_runner = None

    @property
    def policy(self) -> PreTrainedModel:
        return self.step.actor.model

    @property
    def train_images(self) -> list:
        """The training prompts' images (a VL task), row-aligned; empty for a text task."""
        images = self.step.train_set.images
        return images if any(i is not None for i in images) else []

    @property
    def vision_tokens(self):
        """The policy's ``VisionTokens`` (a VL policy), else None."""
        return VisionTokens.of(self.policy.config)

    @property
    def lora(self):
        """The policy's ``LoRAPolicy`` when it trains LoRA adapters (``model.lora.rank > 0``), else None."""
        return self.step.rollout.lora

    def describe_model(self) -> str:
        n = sum(p.numel() for p in self.policy.parameters())
        c, lm = self.policy.config, self.policy.config.get_text_config()  # a VL model's language part
        text = f"{c.model_type}, {n / 1e6:.2f}M params, {lm.num_hidden_layers} layers, hidden {lm.hidden_size}"
        return text if self.lora is None else f"{text}, {self.lora.describe()}"


def build_run(cfg: Config, console: Console | None = None, dp: DistContext | None = None) -> Run:
    """Data, model, reward, run directory (locked), then the components (``_step``).

    ``dp``: this rank of a data-parallel job; every rank builds the same model and data
    (same seeds) and its own engine; only rank 0 owns the run directory and its logs."""
    from hybridrl.rewards import RewardRunner
    from hybridrl.checkpoint.train_state import checkpoint_step
    from hybridrl.job.model_factory import DTYPES, builtin_model, builtin_tokenizer
    from hybridrl.trainer.pretrained import load_pretrained

    from hybridrl.pipeline.build import check_composable

    check_engine_choice(cfg)  # refusals first: nothing is built for a run that cannot work
    check_composable(cfg)
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
    gym_task = cfg.data.task.startswith("reasoning_gym:") and not cfg.data.train_files
    shapes_task = cfg.data.task == "shapes" and not cfg.data.train_files
    if m.path:
        model, tokenizer = load_pretrained(m.path, dtype)
    elif agent_task:  # chat markers as tokens, a chat template with tools; positions for a whole episode
        from hybridrl.data.chat_tokenizer import build_chat_char_tokenizer

        tokenizer = build_chat_char_tokenizer()
        model = builtin_model(tokenizer, m, seed=t.seed, max_position_embeddings=max(128, cfg.env.context_tokens))
    elif gym_task:  # free text: printable ASCII, the question as a chat turn
        from hybridrl.data.chat_tokenizer import build_chat_char_tokenizer

        tokenizer = build_chat_char_tokenizer()
        model = builtin_model(tokenizer, m, seed=t.seed,
                              max_position_embeddings=max(128, cfg.data.max_prompt_length + cfg.rollout.max_tokens))
    else:
        tokenizer = builtin_tokenizer(m.arch)  # a VL arch: the chat tokenizer with the vision markers
        model = builtin_model(tokenizer, m, seed=t.seed, max_position_embeddings=128 if not shapes_task else
                              max(128, cfg.data.max_prompt_length + cfg.rollout.max_tokens))
    check_vision_language(cfg, model.config)
    device = dp.device if dp is not None else torch.device(t.device)
    model.to(device)
    sft = demos = None
    if cfg.data.train_files:
        train_set, eval_set = _file_data(cfg, tokenizer, console, model.config)
    elif agent_task:
        from hybridrl.job.agent_data import calculator_data

        train_set, eval_set, demos = calculator_data(cfg, tokenizer)
    elif gym_task:
        train_set, eval_set, sft = _reasoning_gym_data(cfg, tokenizer, console)
    elif shapes_task:
        from hybridrl.job.vl_data import shapes_data

        train_set, eval_set, sft = shapes_data(cfg, tokenizer, model.config)
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
        step = _step(cfg, _Parts(model, tokenizer, device, dp, console), runner, train_set, longest)
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


@dataclass
class _Parts:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dp: DistContext | None
    console: Console


def _step(cfg: Config, parts: _Parts, runner, train_set: PromptSet, longest_prompt: int) -> RLStep:
    """The components, each built from the run's config in one call, the batch source over
    the trainer's engine (``pipeline/build.py``), and the step over them; the source then
    publishes the policy once (the engine's first load is a refit)."""
    from hybridrl.pipeline.build import SourceParts, build_source
    from hybridrl.trainer.actor import Actor
    from hybridrl.trainer.critic import Critic
    from hybridrl.trainer.rollout_worker import RolloutWorker
    from hybridrl.trainer.scoring import RewardScorer

    model, tokenizer, device, dp = parts.model, parts.tokenizer, parts.device, parts.dp
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
    ranks = dp.world_size if dp is not None else 1
    engine = build_engine(cfg, model.config, device=device, ranks=ranks, longest_prompt=longest_prompt,
                          tensor_parallel=mesh.tp if mesh is not None else None, lora=lora)
    distiller = _distiller(cfg, tokenizer, engine, device)
    actor = Actor.from_config(model, cfg, distiller=distiller)
    rollout = RolloutWorker.from_config(engine, cfg.rollout, cfg.refit,
                                        stop=(tokenizer.eos_token_id, vision_ids(model.config)), device=device,
                                        sharded=dp is not None, mesh=mesh, lora=lora)
    critic = Critic.from_config(cfg, model.config, device) if cfg.algo.advantage.estimator == "gae" else None
    scorer = RewardScorer(runner, tokenizer)
    pad_id = tokenizer.pad_token_id or 0
    # the teacher scores each group as it finishes (mode=advantage); in mode=loss, the update does
    teacher = distiller.teacher if distiller is not None and not distiller.as_loss else None
    source = build_source(cfg, SourceParts(local=rollout, groups=group_kind(cfg, train_set, scorer, rollout, pad_id,
                                                                            teacher),
                                           tokenizer=tokenizer, hf_config=model.config,
                                           longest_prompt=longest_prompt, device=device, console=parts.console,
                                           ranks=ranks))
    source.publish(model)  # first load = the refit path
    return RLStep(source=source, scorer=scorer, actor=actor, critic=critic, train_set=train_set, algo=cfg.algo,
                  shape=BatchShape.from_config(cfg, pad_id), dp=dp)


def _distiller(cfg: Config, tokenizer, engine, device):
    """``algo.distill.teacher``: the teacher served by a built-in engine of its own, scoring
    rows as long as the student's engine makes them; None without a teacher."""
    d = cfg.algo.distill
    if d.teacher is None:
        return None
    from hybridrl.trainer.teacher import Distiller, Teacher

    teacher = Teacher.from_config(d, tokenizer, temperature=cfg.rollout.temperature, max_seq_len=engine.max_seq_len,
                                  device=device, max_tokens_per_microbatch=cfg.batch.max_tokens_per_microbatch)
    return Distiller(teacher, d)


def group_kind(cfg: Config, train_set: PromptSet, scorer, rollout, pad_id: int, teacher=None):
    """What one prompt group is: ``rollout.n`` samples, or with ``env.name`` ``rollout.n``
    episodes; ``teacher``: on-policy distillation's, scoring each finished group's tokens."""
    from hybridrl.pipeline.tasks import EpisodeGroups, SingleTurnGroups

    if cfg.env.name is None:
        return SingleTurnGroups(train_set, scorer, rollout.sampling, pad_id=pad_id, teacher=teacher,
                                vision=VisionTokens.of(rollout.engine.hf_config))
    from hybridrl.agents.environment import environment_kind, load_environment

    tools = environment_kind(load_environment(cfg.env.name)) == "tools"
    return EpisodeGroups(train_set, scorer, n=cfg.rollout.n, pad_id=pad_id,
                         reward_reads=cfg.env.reward_input if tools else None,
                         discount=cfg.env.discount, failure_reward=cfg.reward.failure_reward, teacher=teacher)


def eval_episode_runner(cfg: Config, rollout, tokenizer):
    """Episodes for the held-out eval on ``rollout``'s engine, with an environment pool of
    their own (the training producers' pools serve their own engines)."""
    from hybridrl.agents.episodes import EpisodeRunner
    from hybridrl.pipeline.engines import env_pool, episode_limits

    pool = env_pool(cfg)
    renderer = chat_renderer(cfg, tokenizer, rollout.engine.hf_config, pool.schemas)
    return EpisodeRunner(rollout.engine, pool, renderer, tokenizer, rollout.sampling,
                         episode_limits(cfg))


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


def _reasoning_gym_data(cfg: Config, tokenizer, console: Console) -> tuple[PromptSet, PromptSet, tuple]:
    """``data.task=reasoning_gym:...``: the generated splits, and the reference answers as
    the warm start's demonstrations."""
    from hybridrl.data.reasoning_gym import reasoning_gym_problems

    d = cfg.data
    train, held_out, report = reasoning_gym_problems(
        d.task, d.reasoning_gym, tokenizer, sizes=(d.train_size, d.eval_size), seed=d.seed,
        system_prompt=d.system_prompt, max_prompt_length=d.max_prompt_length)
    console(f"data {d.task}: {report.summary()}")
    if not train:
        raise ValueError(f"data.task={d.task}: no usable training prompts; raise data.max_prompt_length "
                         f"(now {d.max_prompt_length}) or change data.reasoning_gym")
    tr, ev = (PromptSet([p.prompt_ids for p in ps], [p.answer for p in ps], [p.text for p in ps])
              for ps in (train, held_out))
    end = [tokenizer.eos_token_id]
    demos = [tokenizer.encode(p.demonstration, add_special_tokens=False) + end for p in train]
    sft = (tr.prompts, demos, [None] * len(train))
    return tr, ev, sft


def prompt_set_from_files(files: list[str], tokenizer, data: DataConfig, console: Console,
                          vision=None) -> PromptSet:
    """Prompts (jsonl, parquet or a ``datasets`` directory) with the skip report printed;
    ``vision``: a VL policy's ``VLPromptRenderer`` (``pipeline/engines.py::vl_prompt_renderer``)."""
    from hybridrl.data.files import load_prompt_files

    recs, report = load_prompt_files(files, tokenizer, prompt_key=data.prompt_key, answer_key=data.answer_key,
                                     max_prompt_length=data.max_prompt_length, system_prompt=data.system_prompt,
                                     vision=vision)
    console(f"data {', '.join(files)}: {report.summary()}")
    return PromptSet([r.prompt_ids for r in recs], [r.answer for r in recs],
                     [tokenizer.decode(r.prompt_ids, skip_special_tokens=True) for r in recs],
                     [r.images for r in recs])



def _file_data(cfg: Config, tokenizer, console: Console, hf_config) -> tuple[PromptSet, PromptSet]:
    d = cfg.data
    vision = vl_prompt_renderer(cfg, tokenizer, hf_config)
    train = prompt_set_from_files(d.train_files, tokenizer, d, console, vision)
    if not train.prompts:
        raise ValueError(f"data.train_files {d.train_files}: no usable prompts (see the skip counts above)")
    if d.val_files:
        return train, prompt_set_from_files(d.val_files, tokenizer, d, console, vision)
    rng = random.Random(d.seed)
    order = list(range(len(train.prompts)))
    rng.shuffle(order)
    n_eval = min(d.eval_size, max(1, len(order) // 20))
    ev_idx, tr_idx = order[:n_eval], order[n_eval:] or order
    return train.subset(tr_idx), train.subset(ev_idx)
