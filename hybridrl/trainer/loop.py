"""The RL loop: the only place that knows the order of one step.

    prompts ─► engine.generate ─► rewards ─► old/ref log-probs ─► advantages
            ─► actor.update ─► refit (actor weights ─► engine, in place) ─► next step
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridrl.config import Config
from hybridrl.config_io import config_to_yaml
from hybridrl.trainer.progress import progress_bar
from hybridrl.trainer.rl_step import rl_step
from hybridrl.trainer.setup import RunParts, attach_reference, build_run
from hybridrl.trainer.metrics_log import plot_curves

__all__ = ["train", "TrainResult"]


@dataclass
class TrainResult:
    run_dir: Path
    warm_start_accuracy: float | None
    final_accuracy: float | None
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def evaluate(parts: RunParts, max_tokens: int) -> float:
    """Greedy exact-answer accuracy (reward > 0.5) on the held-out prompts."""
    from hybridrl.rollout import SamplingParams

    ev = parts.eval_set
    if not ev.prompts:
        return float("nan")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=parts.stop_ids)
    out = parts.engine.generate(ev.prompts, params)
    texts = parts.decode(out.response_token_ids)
    scores = parts.reward.score(texts, ev.answers, ev.prompt_texts).scores
    return sum(s > 0.5 for s in scores) / len(scores)


def warm_start(parts: RunParts, cfg: Config) -> None:
    """Supervised steps on (prompt, answer) pairs, then one refit so the engine sees them."""
    from hybridrl.trainer.sft import sample_sft_batch, sft_batch, sft_step

    steps = cfg.trainer.sft_steps
    if steps <= 0 or parts.sft_pairs is None:
        return
    prompts, answers = parts.sft_pairs
    opt = torch.optim.AdamW(parts.actor.model.parameters(), lr=cfg.optim.sft_lr, betas=tuple(cfg.optim.betas),
                            weight_decay=cfg.optim.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.05, 1 - s / steps))
    rng = random.Random(cfg.trainer.seed)
    parts.actor.model.train()
    bar = progress_bar(range(steps), desc="warm start", enabled=cfg.logging.progress)
    for _ in bar:
        p, a = sample_sft_batch(rng, prompts, answers, cfg.trainer.sft_batch_size)
        ids, mask, labels = (x.to(parts.device) for x in sft_batch(p, a, parts.pad_id))
        loss, _ = sft_step(parts.actor.model, opt, ids, mask, labels, cfg.optim.grad_clip)
        sched.step()
        bar.set_postfix(loss=f"{loss:.3f}")
    parts.refit()


def train(cfg: Config) -> TrainResult:
    """Run the whole job described by ``cfg``; returns accuracies and the run directory."""
    t_start = time.perf_counter()
    parts = build_run(cfg)
    run_dir = parts.run_dir
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    parts.console(f"run dir: {run_dir}  |  model: {parts.describe_model()}  |  "
                  f"train prompts: {len(parts.train_set.prompts)}, eval prompts: {len(parts.eval_set.prompts)}")
    warm_start(parts, cfg)
    attach_reference(parts)
    warm_acc = evaluate(parts, cfg.rollout.max_tokens)
    parts.console(f"eval after warm start: accuracy {warm_acc:.3f}")
    parts.log.log(0, {"eval/accuracy": warm_acc})
    rng = random.Random(cfg.trainer.seed + 1)
    acc = warm_acc
    bar = progress_bar(range(1, cfg.trainer.total_steps + 1), desc="GRPO" if cfg.algo.adv_estimator == "grpo"
                       else cfg.algo.adv_estimator, enabled=cfg.logging.progress)
    try:
        acc = _rl_phase(parts, cfg, bar, rng, acc)
    finally:
        parts.log.close()
        parts.reward.close()
    if cfg.logging.plot:
        plot_curves(parts.log.rows, run_dir / "curves.png", warm_start_accuracy=warm_acc)
    if cfg.trainer.save_checkpoint:
        parts.save_checkpoint(config_yaml=config_to_yaml(cfg), step=cfg.trainer.total_steps)
    seconds = time.perf_counter() - t_start
    parts.console(f"done in {seconds:.0f}s: accuracy {warm_acc:.3f} (warm start) -> {acc:.3f} (final); "
                  f"outputs in {run_dir}")
    return TrainResult(run_dir=run_dir, warm_start_accuracy=warm_acc, final_accuracy=acc,
                       history=parts.log.rows, seconds=seconds)


def _rl_phase(parts: RunParts, cfg: Config, bar, rng: random.Random, acc: float) -> float:
    """The RL steps with periodic eval and checkpoints; returns the last eval accuracy."""
    for step in bar:
        metrics = rl_step(parts, cfg, step, rng)
        if step % cfg.trainer.eval_every == 0 or step == cfg.trainer.total_steps:
            acc = evaluate(parts, cfg.rollout.max_tokens)
            metrics["eval/accuracy"] = acc
            parts.console(f"step {step}: eval accuracy {acc:.3f}  reward {metrics['reward/mean']:.3f}  "
                          f"kl {metrics.get('actor/kl', 0.0):.4f}  {metrics['perf/tokens_per_s']:.0f} tok/s")
        parts.log.log(step, metrics)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", acc=f"{acc:.2f}")
        every = cfg.trainer.save_every
        if every and step % every == 0 and step != cfg.trainer.total_steps:
            parts.save_checkpoint(config_yaml=config_to_yaml(cfg), step=step)
    return acc
