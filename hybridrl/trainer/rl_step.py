"""One RL step, phase by phase: sample → score → log-probs → advantages → update → refit.

Each phase is a small function over a :class:`StepBatch`; ``rl_step`` runs them in order
and times them. Tensors are ``[B, L]`` right-padded rows (docs/interfaces.md), rows are
prompt-major with ``rollout.n`` consecutive samples per prompt (``index`` = prompt id).
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field

import torch

from hybridrl import algos
from hybridrl.config import Config


@dataclass
class StepBatch:
    batch_idx: list[int]  # training-set row of each prompt
    index: list[int]  # prompt id of each response row [B]
    rollouts: object  # hybridrl.rollout.Rollouts, tensors on the trainer device
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # what actor.update reads
    raw_scores: torch.Tensor | None = None  # [B] verifier scores
    scores: torch.Tensor | None = None  # [B] after overlong shaping
    returns: torch.Tensor | None = None
    values: torch.Tensor | None = None
    failures: int = 0


def needs_old_log_prob(cfg: Config) -> bool:
    """Whether the step needs a separate no-grad log-prob pass before the update.

    It does not when the update is on-policy (one epoch over one mini-batch) and no
    correction reads the old log-probs first (TIS, sequence masking, KL in the reward):
    then the update's own forward gives them, and one forward pass per step is saved.
    """
    a, t = cfg.algo, cfg.trainer
    off_policy = t.ppo_epochs > 1 or t.mini_batch_size < t.prompts_per_step * cfg.rollout.n
    return (off_policy or a.tis_cap is not None or a.mismatch_seq_upper is not None
            or (a.kl_coef > 0 and not a.use_kl_loss))


def sample(parts, cfg: Config, rng: random.Random) -> StepBatch:
    """Draw prompts (without replacement) and sample ``rollout.n`` responses for each.

    One seed per prompt: with a shared seed the j-th sample of every prompt would reuse
    the same random stream, correlating the noise across the whole batch.
    """
    from hybridrl.rollout import SamplingParams

    r = cfg.rollout
    batch_idx = rng.sample(range(len(parts.train_set.prompts)), cfg.trainer.prompts_per_step)
    base = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_tokens=r.max_tokens,
                          stop_token_ids=parts.stop_ids, n=r.n)
    params = [dataclasses.replace(base, seed=rng.randrange(2**62)) for _ in batch_idx]
    ro = parts.engine.generate([parts.train_set.prompts[i] for i in batch_idx], params)
    for name in ("input_ids", "attention_mask", "response_mask", "logprobs"):
        setattr(ro, name, getattr(ro, name).to(parts.device))
    sb = StepBatch(batch_idx=batch_idx, index=[i for i in range(len(batch_idx)) for _ in range(r.n)], rollouts=ro)
    sb.tensors = _row_tensors(ro, sb.index, parts.device)
    return sb


def _row_tensors(ro, index: list[int], device) -> dict[str, torch.Tensor]:
    """What the update reads per row: ``[B, L]`` tensors, plus ``prompt_len`` and ``group``
    ``[B]`` so the trainer can run each group's shared prompt once."""
    return {"input_ids": ro.input_ids, "attention_mask": ro.attention_mask, "response_mask": ro.response_mask,
            "rollout_log_prob": ro.logprobs,
            "prompt_len": torch.tensor(ro.prompt_lengths, dtype=torch.long, device=device),
            "group": torch.tensor(index, dtype=torch.long, device=device)}


def score(parts, cfg: Config, sb: StepBatch) -> None:
    """Verifier scores ``[B]``, plus DAPO's soft overlong penalty when configured."""
    a, ro = cfg.algo, sb.rollouts
    rows = [sb.batch_idx[i] for i in sb.index]
    rb = parts.reward.score(parts.decode(ro.response_token_ids), [parts.train_set.answers[i] for i in rows],
                            [parts.train_set.prompt_texts[i] for i in rows])
    sb.failures = sum(rb.failures.values())
    sb.raw_scores = torch.tensor(rb.scores, dtype=torch.float32, device=parts.device)
    sb.scores = sb.raw_scores
    if a.overlong_buffer_len > 0:
        sb.scores = sb.raw_scores + algos.overlong_reward_penalty(
            ro.response_mask.sum(-1).cpu(), max_response_length=cfg.rollout.max_tokens,
            overlong_buffer_len=a.overlong_buffer_len, overlong_penalty_factor=a.overlong_penalty_factor,
        ).to(parts.device)


def merge(parts, a: StepBatch, b: StepBatch) -> StepBatch:
    """One scored batch from two (rows of ``b`` after ``a``; ``b``'s prompt ids shifted)."""
    from hybridrl.rollout.rollouts import build_rollouts

    ra, rb = a.rollouts, b.rollouts
    ro = build_rollouts(ra.prompt_token_ids + rb.prompt_token_ids, ra.response_token_ids + rb.response_token_ids,
                        ra.response_logprobs + rb.response_logprobs, ra.finish_reasons + rb.finish_reasons,
                        min(ra.weight_version, rb.weight_version), parts.pad_id)
    for name in ("input_ids", "attention_mask", "response_mask", "logprobs"):
        setattr(ro, name, getattr(ro, name).to(parts.device))
    sb = StepBatch(batch_idx=a.batch_idx + b.batch_idx, index=a.index + [i + len(a.batch_idx) for i in b.index],
                   rollouts=ro, failures=a.failures + b.failures)
    sb.tensors = _row_tensors(ro, sb.index, parts.device)
    sb.raw_scores = torch.cat([a.raw_scores, b.raw_scores])
    sb.scores = torch.cat([a.scores, b.scores])
    return sb


def sample_and_score(parts, cfg: Config, rng: random.Random) -> tuple[StepBatch, dict[str, float]]:
    """Sample and score one batch; with DAPO dynamic sampling and refill rounds, keep sampling
    more prompts until enough groups have differing rewards (or the rounds run out)."""
    sb = sample(parts, cfg, rng)
    score(parts, cfg, sb)
    a, rounds = cfg.algo, 0
    if a.dynamic_sampling:
        want = cfg.trainer.prompts_per_step * cfg.rollout.n
        while rounds < a.dynamic_sampling_refill_rounds and len(algos.dynamic_sampling_keep(sb.raw_scores, sb.index)) < want:
            extra = sample(parts, cfg, rng)
            score(parts, cfg, extra)
            sb = merge(parts, sb, extra)
            rounds += 1
    return sb, ({"batch/refill_rounds": float(rounds)} if a.dynamic_sampling else {})


def log_probs(parts, cfg: Config, sb: StepBatch) -> dict[str, float]:
    """Old log-probs (only when needed, see :func:`needs_old_log_prob`) and reference log-probs."""
    from hybridrl.trainer.actor import logprobs_in_microbatches

    ro, metrics = sb.rollouts, {}
    if needs_old_log_prob(cfg):
        sb.tensors["old_log_prob"], _ = parts.actor.compute_log_prob(
            ro.input_ids, ro.attention_mask, ro.response_mask, temperature=cfg.rollout.temperature)
    if parts.ref_model is not None:
        ref, _ = logprobs_in_microbatches(parts.ref_model, ro.input_ids, ro.attention_mask, ro.response_mask,
                                          temperature=cfg.rollout.temperature,
                                          max_tokens=cfg.trainer.max_tokens_per_microbatch)
        sb.tensors["ref_log_prob"] = ref
        # KL of the sampling policy to the reference (the engine's log-probs are the policy's)
        kl = algos.kl_penalty(ro.logprobs, ref, cfg.algo.kl_estimator)
        metrics["actor/kl"] = float(algos.masked_mean(kl, ro.response_mask))
    return metrics


def compute_advantages(*, adv_estimator: str, scores: torch.Tensor, response_mask: torch.Tensor, index: list[int],
                       norm_adv_by_std_in_grpo: bool, gamma: float, lam: float,
                       values: torch.Tensor | None = None, reward_baselines: torch.Tensor | None = None,
                       token_level_rewards: torch.Tensor | None = None):
    """``(advantages, returns)`` ``[B, L]`` by the registered estimator."""
    if token_level_rewards is None:
        token_level_rewards = algos.scores_to_token_level_rewards(scores, response_mask)
    fn = algos.get_adv_estimator(adv_estimator)
    return fn(token_level_rewards=token_level_rewards, response_mask=response_mask, index=index,
              norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, gamma=gamma, lam=lam, values=values,
              reward_baselines=reward_baselines)


def advantages(parts, cfg: Config, sb: StepBatch) -> dict[str, float]:
    """Token rewards (KL penalty in the reward if configured), then advantages and returns."""
    a, ro, metrics = cfg.algo, sb.rollouts, {}
    token_rewards = algos.scores_to_token_level_rewards(sb.scores, ro.response_mask)
    if parts.ref_model is not None and not a.use_kl_loss:
        token_rewards, kl_m = algos.apply_kl_penalty(
            token_level_rewards=token_rewards, old_log_prob=sb.tensors["old_log_prob"],
            ref_log_prob=sb.tensors["ref_log_prob"], response_mask=ro.response_mask, kl_ctrl=parts.kl_ctrl,
            kind=a.kl_estimator)
        metrics.update({f"actor/{k}": float(v) for k, v in kl_m.items()})
    sb.values = parts.critic_values(sb.tensors) if parts.critic is not None else None
    baselines = None
    if a.adv_estimator == "remax":
        prompts = [parts.train_set.prompts[i] for i in sb.batch_idx]
        baselines = parts.greedy_baselines(prompts, [parts.train_set.answers[i] for i in sb.batch_idx],
                                           [parts.train_set.prompt_texts[i] for i in sb.batch_idx], sb.index)
    sb.tensors["advantages"], sb.returns = compute_advantages(
        adv_estimator=a.adv_estimator, scores=sb.scores, response_mask=ro.response_mask, index=sb.index,
        norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo, gamma=a.gamma, lam=a.lam, values=sb.values,
        reward_baselines=baselines, token_level_rewards=token_rewards)
    return metrics


def corrections(cfg: Config, sb: StepBatch) -> dict[str, float]:
    """Rollout/trainer mismatch (TIS weights, sequence masking) and DAPO truncation masking."""
    a, ro, metrics = cfg.algo, sb.rollouts, {}
    mask, old = ro.response_mask, sb.tensors.get("old_log_prob")
    if a.tis_cap is not None:
        sb.tensors["rollout_is_weights"], m = algos.compute_tis_weights(old, ro.logprobs, mask, tis_cap=a.tis_cap)
        metrics.update({f"actor/{k}": float(v) for k, v in m.items()})
    if a.mismatch_seq_upper is not None:
        mask, m = algos.compute_seq_mismatch_mask(old, ro.logprobs, mask, upper=a.mismatch_seq_upper,
                                                  lower=a.mismatch_seq_lower)
        metrics.update({f"actor/{k}": float(v) for k, v in m.items()})
    if a.overlong_filter:
        mask, truncated = algos.mask_truncated_responses(mask, finish_reasons=ro.finish_reasons)
        metrics["batch/truncated_masked"] = float(truncated.float().mean())
    sb.tensors["response_mask"] = mask
    return metrics


def update(parts, cfg: Config, sb: StepBatch) -> dict[str, float]:
    """Actor (and critic) update on the kept rows (DAPO dynamic sampling drops flat groups)."""
    metrics = {}
    keep = torch.arange(len(sb.index))
    if cfg.algo.dynamic_sampling:
        keep = algos.dynamic_sampling_keep(sb.raw_scores, sb.index)
        metrics["batch/kept_fraction"] = len(keep) / len(sb.index)
        if cfg.algo.dynamic_sampling_refill_rounds > 0:  # DAPO trains on a full batch of kept groups
            keep = keep[: cfg.trainer.prompts_per_step * cfg.rollout.n]
    if len(keep) == 0:
        return metrics
    kept = {k: v[keep] for k, v in sb.tensors.items()}
    mb = min(cfg.trainer.mini_batch_size, len(keep))
    metrics.update(parts.actor.update(kept, parts.loss_spec, mini_batch_size=mb, epochs=cfg.trainer.ppo_epochs,
                                      temperature=cfg.rollout.temperature, generator=parts.torch_gen))
    if parts.critic is not None:
        metrics.update(parts.update_critic({**kept, "returns": sb.returns[keep], "values": sb.values[keep]}))
    return metrics


def rl_step(parts, cfg: Config, step: int, rng: random.Random) -> dict[str, float]:
    """One RL step; returns its metrics (phase seconds included)."""
    t: dict[str, float] = {}
    metrics: dict[str, float] = {}

    def timed(name, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        t[name] = t.get(name, 0.0) + time.perf_counter() - t0
        if isinstance(out, dict):
            metrics.update(out)
        return out

    if cfg.algo.dynamic_sampling and cfg.algo.dynamic_sampling_refill_rounds > 0:
        sb, extra = timed("rollout", sample_and_score, parts, cfg, rng)  # refills interleave both phases
        metrics.update(extra)
        t["reward"] = 0.0
    else:
        sb = timed("rollout", sample, parts, cfg, rng)
        timed("reward", score, parts, cfg, sb)
    timed("log_probs", log_probs, parts, cfg, sb)
    timed("log_probs", advantages, parts, cfg, sb)  # critic values / ReMax baselines count as log-prob work
    metrics.update(corrections(cfg, sb))
    timed("update", update, parts, cfg, sb)
    stats = timed("refit", parts.refit)
    metrics.update(step_metrics(sb, stats, t))
    return metrics


def step_metrics(sb: StepBatch, stats, t: dict[str, float]) -> dict[str, float]:
    ro, raw = sb.rollouts, sb.raw_scores
    n_tokens = float(ro.response_mask.sum())
    out = {
        "reward/mean": float(raw.mean()), "reward/std": float(raw.std()) if raw.numel() > 1 else 0.0,
        "reward/failures": float(sb.failures),
        "response/length_mean": float(ro.response_mask.sum(-1).float().mean()),
        "response/truncated_fraction": sum(f == "length" for f in ro.finish_reasons) / len(ro.finish_reasons),
        "rollout/weight_version": ro.weight_version, "refit/weight_version": stats.version,
        "perf/tokens_per_s": n_tokens / max(sum(t.values()), 1e-9),
        "perf/rollout_tokens_per_s": n_tokens / max(t["rollout"], 1e-9),
    }
    out.update({f"time/{k}_s": v for k, v in t.items()})
    return out
