"""The RL loop: the only place that knows the order of one step.

    prompts ─► engine.generate ─► rewards ─► old/ref log-probs ─► advantages
            ─► actor.update ─► refit (actor weights ─► engine, in place) ─► next step
"""

from __future__ import annotations

import copy
import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridrl import algos
from hybridrl.config import Config, config_to_yaml
from hybridrl.trainer.progress import progress_bar
from hybridrl.trainer.rl_step import compute_advantages, shape_scores
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


def needs_old_log_prob(cfg: Config) -> bool:
    """Whether the step needs a separate no-grad log-prob pass before the update.

    It does not when the update is on-policy (one epoch over one mini-batch) and no
    correction reads the old log-probs first (TIS, sequence masking, KL in the reward):
    then the update's own forward gives them, and one forward pass per step is saved.
    """
    a, t = cfg.algo, cfg.trainer
    batch = t.prompts_per_step * cfg.rollout.n
    off_policy = t.ppo_epochs > 1 or t.mini_batch_size < batch
    return (off_policy or a.tis_cap is not None or a.mismatch_seq_upper is not None
            or (a.kl_coef > 0 and not a.use_kl_loss))


def rl_step(parts: RunParts, cfg: Config, step: int, rng: random.Random) -> dict[str, float]:
    """One RL step; returns its metrics (phase seconds included)."""
    from hybridrl.rollout import SamplingParams

    a, r = cfg.algo, cfg.rollout
    t = {}
    t0 = time.perf_counter()
    # Without replacement within a step, and one seed per prompt: with a shared seed the
    # j-th sample of every prompt would reuse the same random stream (correlated noise).
    batch_idx = rng.sample(range(len(parts.train_set.prompts)), cfg.trainer.prompts_per_step)
    prompts = [parts.train_set.prompts[i] for i in batch_idx]
    base = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_tokens=r.max_tokens,
                          stop_token_ids=parts.stop_ids, n=r.n)
    params = [dataclasses.replace(base, seed=rng.randrange(2**62)) for _ in prompts]
    ro = parts.engine.generate(prompts, params)
    for name in ("input_ids", "attention_mask", "response_mask", "logprobs"):
        setattr(ro, name, getattr(ro, name).to(parts.device))
    t["rollout"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    index = [i for i in range(len(prompts)) for _ in range(r.n)]
    texts = parts.decode(ro.response_token_ids)
    answers = [parts.train_set.answers[batch_idx[i]] for i in index]
    ptexts = [parts.train_set.prompt_texts[batch_idx[i]] for i in index]
    rb = parts.reward.score(texts, answers, ptexts)
    raw = torch.tensor(rb.scores, dtype=torch.float32, device=parts.device)
    lengths = ro.response_mask.sum(-1)
    scores = shape_scores(raw, lengths=lengths, max_tokens=r.max_tokens, overlong_buffer_len=a.overlong_buffer_len,
                          overlong_penalty_factor=a.overlong_penalty_factor)
    t["reward"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    batch = {"input_ids": ro.input_ids, "attention_mask": ro.attention_mask, "response_mask": ro.response_mask,
             "rollout_log_prob": ro.logprobs}
    temperature = r.temperature  # 0 = greedy: scored at 1, as the engine reports
    metrics: dict[str, float] = {}
    old_lp = None
    if needs_old_log_prob(cfg):
        old_lp, _ = parts.actor.compute_log_prob(ro.input_ids, ro.attention_mask, ro.response_mask,
                                                 temperature=temperature)
        batch["old_log_prob"] = old_lp
    if parts.ref_model is not None:
        from hybridrl.trainer.actor import logprobs_in_microbatches
        ref_lp, _ = logprobs_in_microbatches(parts.ref_model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                             temperature=temperature, max_tokens=cfg.trainer.max_tokens_per_microbatch)
        batch["ref_log_prob"] = ref_lp
        # KL of the sampling policy to the reference (the engine's log-probs are the policy's)
        metrics["actor/kl"] = float(algos.masked_mean(algos.kl_penalty(ro.logprobs, ref_lp, a.kl_estimator),
                                                      ro.response_mask))
    t["log_probs"] = time.perf_counter() - t0

    token_rewards = algos.scores_to_token_level_rewards(scores, ro.response_mask)
    if parts.ref_model is not None and not a.use_kl_loss:
        token_rewards, kl_m = algos.apply_kl_penalty(token_level_rewards=token_rewards, old_log_prob=batch["old_log_prob"],
                                                     ref_log_prob=batch["ref_log_prob"], response_mask=ro.response_mask,
                                                     kl_ctrl=parts.kl_ctrl, kind=a.kl_estimator)
        metrics.update({f"actor/{k}": float(v) for k, v in kl_m.items()})
    values = parts.critic_values(batch) if parts.critic is not None else None
    baselines = None
    if a.adv_estimator == "remax":
        baselines = parts.greedy_baselines(prompts, [parts.train_set.answers[i] for i in batch_idx],
                                           [parts.train_set.prompt_texts[i] for i in batch_idx], index)
    adv, returns = compute_advantages(adv_estimator=a.adv_estimator, scores=scores, response_mask=ro.response_mask,
                                      index=index, norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo, gamma=a.gamma,
                                      lam=a.lam, values=values, reward_baselines=baselines,
                                      token_level_rewards=token_rewards)
    batch["advantages"] = adv
    mask = ro.response_mask
    if a.tis_cap is not None:
        w, tis_m = algos.compute_tis_weights(old_lp, ro.logprobs, mask, tis_cap=a.tis_cap)
        batch["rollout_is_weights"] = w
        metrics.update({f"actor/{k}": float(v) for k, v in tis_m.items()})
    if a.mismatch_seq_upper is not None:
        mask, mm = algos.compute_seq_mismatch_mask(old_lp, ro.logprobs, mask, upper=a.mismatch_seq_upper,
                                                   lower=a.mismatch_seq_lower)
        metrics.update({f"actor/{k}": float(v) for k, v in mm.items()})
    if a.overlong_filter:
        mask, truncated = algos.mask_truncated_responses(mask, finish_reasons=ro.finish_reasons)
        metrics["batch/truncated_masked"] = float(truncated.float().mean())
    batch["response_mask"] = mask

    keep = torch.arange(len(index))
    if a.dynamic_sampling:
        keep = algos.dynamic_sampling_keep(raw, index)
        metrics["batch/kept_fraction"] = len(keep) / len(index)
    t0 = time.perf_counter()
    if len(keep) > 0:
        kept = {k: v[keep] for k, v in batch.items()}
        mb = min(cfg.trainer.mini_batch_size, len(keep))
        metrics.update(parts.actor.update(kept, parts.loss_spec, mini_batch_size=mb, epochs=cfg.trainer.ppo_epochs,
                                          temperature=r.temperature, generator=parts.torch_gen))
        if parts.critic is not None:
            metrics.update(parts.update_critic({**kept, "returns": returns[keep], "values": values[keep]}))
    t["update"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    stats = parts.refit()
    t["refit"] = time.perf_counter() - t0

    n_tokens = float(ro.response_mask.sum())
    metrics.update({
        "reward/mean": float(raw.mean()), "reward/std": float(raw.std()) if raw.numel() > 1 else 0.0,
        "reward/failures": float(sum(rb.failures.values())),
        "response/length_mean": float(lengths.float().mean()),
        "response/truncated_fraction": sum(f == "length" for f in ro.finish_reasons) / len(ro.finish_reasons),
        "rollout/weight_version": ro.weight_version, "refit/weight_version": stats.version,
        "perf/tokens_per_s": n_tokens / max(sum(t.values()), 1e-9),
        "perf/rollout_tokens_per_s": n_tokens / max(t["rollout"], 1e-9),
    })
    metrics.update({f"time/{k}_s": v for k, v in t.items()})
    return metrics


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


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
