"""The RL job: build, warm start, attach the reference, then RL steps with periodic eval
and checkpoints. The order *inside* a step is :class:`~hybridrl.trainer.rl_step.RLStep`'s.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridrl.config import Config
from hybridrl.config_io import config_to_yaml
from hybridrl.trainer.build import Run, build_run
from hybridrl.trainer.metrics_log import plot_curves
from hybridrl.trainer.progress import progress_bar
from hybridrl.trainer.reference import Reference
from hybridrl.trainer.scoring import greedy_accuracy

__all__ = ["train", "TrainResult"]


@dataclass
class TrainResult:
    run_dir: Path
    warm_start_accuracy: float | None
    final_accuracy: float | None
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def evaluate(run: Run) -> float:
    """Greedy exact-answer accuracy (reward > 0.5) on the held-out prompts."""
    return greedy_accuracy(run.step.rollout, run.step.scorer, run.eval_set)


def warm_start(run: Run, cfg: Config) -> None:
    """Supervised steps on (prompt, answer) pairs, then one refit so the engine sees them."""
    from hybridrl.trainer.sft import sample_sft_batch, sft_batch, sft_step

    steps = cfg.trainer.sft_steps
    if steps <= 0 or run.sft_pairs is None:
        return
    prompts, answers = run.sft_pairs
    model, device = run.policy, run.step.rollout.device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.sft_lr, betas=tuple(cfg.optim.betas),
                            weight_decay=cfg.optim.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.05, 1 - s / steps))
    rng = random.Random(cfg.trainer.seed)
    model.train()
    bar = progress_bar(range(steps), desc="warm start", enabled=cfg.logging.progress)
    for _ in bar:
        p, a = sample_sft_batch(rng, prompts, answers, cfg.trainer.sft_batch_size)
        ids, mask, labels = (x.to(device) for x in sft_batch(p, a, run.step.pad_id))
        loss, _ = sft_step(model, opt, ids, mask, labels, cfg.optim.grad_clip)
        sched.step()
        bar.set_postfix(loss=f"{loss:.3f}")
    run.step.rollout.refit(model)


def train(cfg: Config) -> TrainResult:
    """Run the whole job described by ``cfg``; returns accuracies and the run directory."""
    t_start = time.perf_counter()
    run = build_run(cfg)
    run_dir = run.run_dir
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    run.console(f"run dir: {run_dir}  |  model: {run.describe_model()}  |  "
                f"train prompts: {len(run.step.train_set)}, eval prompts: {len(run.eval_set)}")
    warm_start(run, cfg)
    if cfg.algo.kl.coef > 0:
        run.step.attach_reference(Reference.frozen_copy_of(
            run.policy, temperature=cfg.rollout.temperature,
            max_tokens_per_microbatch=cfg.trainer.max_tokens_per_microbatch))
    warm_acc = evaluate(run)
    run.console(f"eval after warm start: accuracy {warm_acc:.3f}")
    run.log.log(0, {"eval/accuracy": warm_acc})
    rng = random.Random(cfg.trainer.seed + 1)
    acc = warm_acc
    estimator = cfg.algo.advantage.estimator
    bar = progress_bar(range(1, cfg.trainer.total_steps + 1), desc="GRPO" if estimator == "grpo" else estimator,
                       enabled=cfg.logging.progress)
    try:
        acc = _rl_phase(run, cfg, bar, rng, acc)
    finally:
        run.log.close()
        run.step.scorer.close()
    if cfg.logging.plot:
        plot_curves(run.log.rows, run_dir / "curves.png", warm_start_accuracy=warm_acc)
    if cfg.trainer.save_checkpoint:
        _save(run, cfg, cfg.trainer.total_steps)
    seconds = time.perf_counter() - t_start
    run.console(f"done in {seconds:.0f}s: accuracy {warm_acc:.3f} (warm start) -> {acc:.3f} (final); "
                f"outputs in {run_dir}")
    return TrainResult(run_dir=run_dir, warm_start_accuracy=warm_acc, final_accuracy=acc,
                       history=run.log.rows, seconds=seconds)


def _save(run: Run, cfg: Config, step: int) -> Path:
    from hybridrl.trainer.checkpoint import save_checkpoint_atomic

    path = save_checkpoint_atomic(run.policy, run.tokenizer, run.run_dir / "checkpoint", step=step,
                                  extra_files={"hybridrl_config.yaml": config_to_yaml(cfg)})
    if run.step.critic is not None:
        run.step.critic.model.save_pretrained(run.run_dir / "critic")
    return path


def _rl_phase(run: Run, cfg: Config, bar, rng: random.Random, acc: float) -> float:
    """The RL steps with periodic eval and checkpoints; returns the last eval accuracy."""
    for step in bar:
        metrics = run.step(rng)
        if step % cfg.trainer.eval_every == 0 or step == cfg.trainer.total_steps:
            acc = evaluate(run)
            metrics["eval/accuracy"] = acc
            run.console(f"step {step}: eval accuracy {acc:.3f}  reward {metrics['reward/mean']:.3f}  "
                        f"kl {metrics.get('actor/kl', 0.0):.4f}  {metrics['perf/tokens_per_s']:.0f} tok/s")
        run.log.log(step, metrics)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", acc=f"{acc:.2f}")
        every = cfg.trainer.save_every
        if every and step % every == 0 and step != cfg.trainer.total_steps:
            _save(run, cfg, step)
    return acc
