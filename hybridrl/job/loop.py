"""The RL job: build, warm start, attach the reference, then RL steps with periodic eval
and checkpoints. The order *inside* a step is :class:`~hybridrl.trainer.rl_step.RLStep`'s.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridrl.config import Config
from hybridrl.config.io import config_to_yaml
from hybridrl.job.build import Run, build_run
from hybridrl.job.interrupt import InterruptFlag, TrainingInterrupted
from hybridrl.job.metrics_log import plot_curves
from hybridrl.job.progress import progress_bar
from hybridrl.trainer.reference import Reference
from hybridrl.job.evaluation import EvalResult, evaluate_episodes, evaluate_prompts

__all__ = ["train", "TrainResult"]


@dataclass
class TrainResult:
    run_dir: Path
    warm_start_accuracy: float | None
    final_accuracy: float | None
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def evaluate(run: Run) -> EvalResult:
    """Greedy accuracy (reward > 0.5) on the held-out prompts (an agent's: on greedy
    episodes), plus pass@k / maj@k when ``eval.k > 0`` (see ``evaluation.py``)."""
    e = run.cfg.eval
    if run.cfg.env.name is not None:  # an agent: greedy episodes, final answers scored
        return evaluate_episodes(run.eval_episodes(), run.step.scorer, run.eval_set, k=e.k,
                                 temperature=e.temperature, seed=e.seed)
    return evaluate_prompts(run.step.fresh_rollout(), run.step.scorer, run.eval_set, k=e.k, temperature=e.temperature,
                            seed=e.seed)


def _extra(result: EvalResult) -> str:
    extra = f"  pass@{result.k} {result.pass_at_k:.3f}  maj@{result.k} {result.maj_at_k:.3f}" if result.k else ""
    if result.reward_failures:
        extra += f"  reward failures {result.reward_failures}/{result.reward_calls}"
    return extra


def _step_failures(metrics: dict) -> str:
    """The step line's note on failed reward calls (empty when none failed)."""
    failed = int(metrics.get("reward/failures", 0))
    return f"  reward failures {metrics['reward/failure_rate']:.0%} ({failed})" if failed else ""


def warm_start(run: Run, cfg: Config) -> None:
    """Supervised steps on (prompt, answer) pairs, then one refit so the engine sees them.

    On the built-in task, ``data.teacher_carry_slip`` replaces that share of the carrying
    additions' demonstrations with the slip (the units carry forgotten), drawn afresh at
    every visit: the warm start then imitates a teacher with a systematic error, which
    only the reward can correct. On the agent task (``run.sft_demos``) the pairs are
    multi-turn demonstrations, learned on the assistant's turns only (tool spans masked),
    and the teacher's choice (tool or not) is drawn afresh at every visit the same way.
    """
    from hybridrl.data.vision import hf_vision_kwargs
    from hybridrl.job.sft import masked_sft_batch, sample_sft_batch, sft_batch

    t = cfg.trainer
    steps = cfg.warm_start.steps
    if steps <= 0 or (run.sft_pairs is None and run.sft_demos is None):
        return
    slip_rng = random.Random(t.seed + 7919)  # its own stream: the batches are those of a slip-free run
    rng = random.Random(t.seed)
    model, device, pad_id, k = run.policy, run.step.rollout.device, run.step.shape.pad_id, cfg.warm_start.batch_size
    if run.sft_demos is not None:
        def batch():
            demos = run.sft_demos.sample(rng, k, slip_rng)
            return (*masked_sft_batch([d.ids for d in demos], [d.loss_mask for d in demos], pad_id), {})
    else:
        prompts, answers, slips = run.sft_pairs
        images = run.train_images  # a VL task's prompt images (empty: text)

        def batch():
            p, a, idx = sample_sft_batch(rng, prompts, answers, k, slips=slips,
                                         slip_rate=cfg.data.teacher_carry_slip, slip_rng=slip_rng)
            ids, mask, labels = sft_batch(p, a, pad_id)
            vision = hf_vision_kwargs(ids, [images[i] for i in idx], run.vision_tokens) if images else {}
            return ids, mask, labels, vision
    lora = run.lora  # LoRA: the warm start builds the base (adapters off), the RL trains the adapters
    training = lora.training_base() if lora is not None else contextlib.nullcontext(list(model.parameters()))
    with training as params:
        _warm_start_steps(run, cfg, model, params, batch, steps, device)
    if run.step.dp is not None:  # every rank ran the same steps; make them bitwise one model
        from hybridrl.distributed.context import broadcast_module_

        broadcast_module_(model)
    if lora is not None and (run.step.dp is None or run.step.dp.is_main):
        save_lora_base(run)
    run.step.source.publish(model)


def _warm_start_steps(run: Run, cfg: Config, model, params, batch, steps: int, device) -> None:
    from hybridrl.job.sft import sft_step

    opt = torch.optim.AdamW(params, lr=cfg.warm_start.lr, betas=tuple(cfg.optim.betas),
                            weight_decay=cfg.optim.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.05, 1 - s / steps))
    model.train()
    bar = progress_bar(range(steps), desc="warm start", enabled=cfg.logging.progress)
    for _ in bar:
        ids, mask, labels, vision = batch()
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        vision = {name: x.to(device) for name, x in vision.items()}
        loss, _ = sft_step(model, opt, ids, mask, labels, cfg.optim.grad_clip, vision)
        sched.step()
        bar.set_postfix(loss=f"{loss:.3f}")


LORA_BASE_FILE = "lora_base.safetensors"


def save_lora_base(run: Run) -> None:
    """A LoRA run's base after its warm start, written once into the run directory
    (atomically): checkpoints then hold the adapters only, and a resume reads the base here."""
    from safetensors.torch import save_file

    path = run.run_dir / LORA_BASE_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({n: t.contiguous() for n, t in run.lora.base_tensors()}, str(tmp),
              metadata={"hf_config": run.policy.config.to_json_string()})  # what `hybridrl export` rebuilds
    os.replace(tmp, path)


def load_lora_base(run: Run) -> None:
    """The resume side of :func:`save_lora_base` (no file: the base is ``model.path`` / the seeded init)."""
    path = run.run_dir / LORA_BASE_FILE
    if path.is_file():
        from safetensors.torch import load_file

        run.lora.load_base(load_file(str(path)), f"checkpoint.resume: {path}")


def train(cfg: Config) -> TrainResult:
    """Run the whole job described by ``cfg``; returns accuracies and the run directory.

    With ``checkpoint.resume=auto`` an interrupted run continues from its latest checkpoint
    and ends bit-identical to an uninterrupted one (CPU, float32, one thread)."""
    from hybridrl.distributed.context import init_from_env, launched_distributed

    t_start = time.perf_counter()
    dp = init_from_env(cfg.trainer.device, timeout_s=cfg.launcher.timeout_s) if launched_distributed() else None
    run = build_run(cfg) if dp is None else build_run(cfg, dp=dp)
    try:
        return _train(run, cfg, t_start)
    finally:
        run.step.close()  # the rollout workers of an overlapped run
        run.log.close()
        run.step.scorer.close()
        run.close_eval_episodes()  # the eval's environment workers
        run.directory.close()
        close = getattr(run.step.rollout.engine, "close", None)  # vLLM's engine holds processes / a group
        if close is not None:
            close()


def _train(run: Run, cfg: Config, t_start: float) -> TrainResult:
    from hybridrl.checkpoint.train_state import LoopState, read_training_state

    run_dir = run.run_dir
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    run.console(f"run dir: {run_dir}  |  model: {run.describe_model()}  |  "
                f"train prompts: {len(run.step.train_set)}, eval prompts: {len(run.eval_set)}")
    rng = random.Random(cfg.trainer.seed + 1)
    if run.directory.resume_from is None:
        warm_start(run, cfg)
        _attach_reference(run, cfg)
        if run.step.dp is not None:
            run.step.shard_for_data_parallel()
        warm = evaluate(run)
        warm_acc = warm.accuracy
        run.console(f"eval after warm start: accuracy {warm_acc:.3f}{_extra(warm)}")
        run.log.log(0, warm.metrics())
        loop = LoopState(step=0, warm_start_accuracy=warm_acc, last_accuracy=warm_acc)
    else:
        if run.lora is not None:
            load_lora_base(run)
        _attach_reference(run, cfg)  # a placeholder copy; its weights come from the checkpoint
        if run.step.dp is not None:
            run.step.shard_for_data_parallel()
        loop = read_training_state(run.directory.resume_from, run, rng)
        if loop.step >= cfg.trainer.total_steps:
            raise ValueError(f"run {run_dir} is already complete at step {loop.step} (trainer.total_steps="
                             f"{cfg.trainer.total_steps}); raise trainer.total_steps to continue it, or choose "
                             "another trainer.run_name")
        run.console(f"resumed from {run.directory.resume_from} at step {loop.step}")
    run.step.start(rng, first_step=loop.step + 1)
    estimator = cfg.algo.advantage.estimator
    main = run.step.dp is None or run.step.dp.is_main
    bar = progress_bar(range(loop.step + 1, cfg.trainer.total_steps + 1), initial=loop.step,
                       total=cfg.trainer.total_steps, desc="GRPO" if estimator == "grpo" else estimator,
                       enabled=cfg.logging.progress and main)
    with InterruptFlag() as interrupt:
        _rl_phase(run, cfg, bar, rng, loop, interrupt)
    if cfg.logging.plot and main:
        plot_curves(run.log.rows, run_dir / "curves.png", warm_start_accuracy=loop.warm_start_accuracy)
    if cfg.checkpoint.save:
        _save_final(run, cfg, loop, rng)
    seconds = time.perf_counter() - t_start
    run.console(f"done in {seconds:.0f}s: accuracy {loop.warm_start_accuracy:.3f} (warm start) -> "
                f"{loop.last_accuracy:.3f} (final); outputs in {run_dir}")
    return TrainResult(run_dir=run_dir, warm_start_accuracy=loop.warm_start_accuracy,
                       final_accuracy=loop.last_accuracy, history=run.log.rows, seconds=seconds)


def _attach_reference(run: Run, cfg: Config) -> None:
    if cfg.algo.kl.coef <= 0:
        return
    kw = dict(temperature=cfg.rollout.temperature, max_tokens_per_microbatch=cfg.batch.max_tokens_per_microbatch)
    if run.lora is not None:  # the base under disable_adapter(): no copy
        run.step.attach_reference(Reference(run.policy, adapter_off=run.lora.adapter_disabled, **kw))
    else:
        run.step.attach_reference(Reference.frozen_copy_of(run.policy, **kw))


def save(run: Run, cfg: Config, loop, rng: random.Random) -> Path | None:
    """A full training checkpoint (HF policy + everything a resume needs), atomically.
    Data parallel: every rank takes part in gathering; rank 0 writes (returns None elsewhere)."""
    if run.step.dp is not None:
        from hybridrl.checkpoint.sharded import save_data_parallel
        from hybridrl.checkpoint.train_state import write_training_state

        return save_data_parallel(run, cfg, loop.step, config_to_yaml(cfg),
                                  lambda directory, sources: write_training_state(directory, run, loop, rng,
                                                                                  sharded=True, sources=sources))
    from hybridrl.checkpoint.atomic import save_step_dir, write_hf
    from hybridrl.checkpoint.train_state import write_training_state

    def write(directory: Path) -> None:
        extra = {"hybridrl_config.yaml": config_to_yaml(cfg)}
        if run.lora is not None:  # the adapters only (peft's folder); the base is the run's lora_base
            run.lora.save_adapter(directory)
            write_hf(directory, None, run.tokenizer, extra)
        else:
            write_hf(directory, run.policy, run.tokenizer, extra)
        write_training_state(directory, run, loop, rng)

    return save_step_dir(run.run_dir / "checkpoint", loop.step, write, keep_last=cfg.checkpoint.keep_last)


def _save_final(run: Run, cfg: Config, loop, rng: random.Random) -> Path:
    """The end-of-run checkpoint; if it cannot be written where asked, the weights go to a
    rescue directory under the system temp dir, named in the error."""
    from hybridrl.checkpoint.atomic import CheckpointWriteError

    try:
        return save(run, cfg, loop, rng)
    except CheckpointWriteError as e:
        import tempfile

        rescue = Path(tempfile.mkdtemp(prefix=f"hybridrl-rescue-{run.run_dir.name}-"))
        try:
            run.policy.save_pretrained(rescue, safe_serialization=True)
            run.tokenizer.save_pretrained(rescue)
            where = f"final weights saved to {rescue} instead"
        except OSError:
            where = "the final weights could not be saved anywhere"
        raise CheckpointWriteError(f"{e}; {where}") from None


def _interrupted(run: Run, interrupt: InterruptFlag) -> bool:
    """Whether any rank got SIGINT/SIGTERM (ranks agree, so they all save at the same step)."""
    if run.step.dp is None:
        return interrupt.signum is not None
    import torch.distributed as dist

    from hybridrl.distributed.context import comm_device

    flag = torch.tensor([0 if interrupt.signum is None else interrupt.signum], device=comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    interrupt.signum = int(flag.item()) or None
    return interrupt.signum is not None


def _rl_phase(run: Run, cfg: Config, bar, rng: random.Random, loop, interrupt: InterruptFlag) -> None:
    """The RL steps with periodic eval and checkpoints; updates ``loop`` as it goes."""
    t = cfg.trainer
    for step in bar:
        metrics = run.step(rng)
        loop.step = step
        loop.nonfinite_streak = loop.nonfinite_streak + 1 if metrics.get("actor/nonfinite_skipped") else 0
        if step % t.eval_every == 0 or step == t.total_steps:
            result = evaluate(run)
            loop.last_accuracy = result.accuracy
            metrics.update(result.metrics())
            run.console(f"step {step}: eval accuracy {loop.last_accuracy:.3f}{_extra(result)}  reward "
                        f"{metrics['reward/mean']:.3f}{_step_failures(metrics)}  kl {metrics.get('actor/kl', 0.0):.4f}  "
                        f"{metrics['perf/tokens_per_s']:.0f} tok/s")
        run.log.log(step, metrics)
        postfix = {"reward": f"{metrics['reward/mean']:.2f}", "acc": f"{loop.last_accuracy:.2f}"}
        if metrics.get("reward/failures"):
            postfix["fail"] = f"{metrics['reward/failure_rate']:.0%}"
        bar.set_postfix(**postfix)
        if loop.nonfinite_streak >= t.max_nonfinite_steps:
            last = run.run_dir / "checkpoint"
            good = os.path.realpath(last) if last.is_symlink() else "none yet"
            raise ValueError(f"{loop.nonfinite_streak} consecutive steps had a non-finite loss or gradient (last at "
                             f"step {step}); stopping. Last good checkpoint: {good}; lower optim.lr or check the "
                             "reward scale")
        if _interrupted(run, interrupt):
            path = save(run, cfg, loop, rng) if cfg.checkpoint.save else None
            where = f"checkpoint {path}; continue with checkpoint.resume=auto" if path else "no checkpoint (saving off)"
            raise TrainingInterrupted(f"interrupted at step {step}: {where}", interrupt.signum)
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != t.total_steps and cfg.checkpoint.save:
            save(run, cfg, loop, rng)
