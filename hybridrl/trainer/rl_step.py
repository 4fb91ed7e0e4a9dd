"""One RL step, the recipe, top to bottom:

    take (the source's batch: sampled and scored) → old / reference log-probs → advantages
    → corrections → update (actor, critic) → publish (actor weights → the engines, in place)

:class:`RLStep` holds the typed components and runs exactly this order, the same in every
``trainer.mode``: the batch source (``pipeline/``) decides when and where generation runs;
every phase is timed by one :class:`PhaseTimer`. Under data parallelism every rank runs this
same step on its share of the prompts.
"""

from __future__ import annotations

import random
import typing
from dataclasses import dataclass

import torch

from hybridrl import algos
from hybridrl.config import AlgoConfig, Config
from hybridrl.distributed.context import DistContext
from hybridrl.trainer.actor import Actor, proximal_weights
from hybridrl.trainer.critic import Critic
from hybridrl.trainer.prompts import PromptSet
from hybridrl.trainer.reference import Reference
from hybridrl.trainer.rollout_worker import RolloutWorker
from hybridrl.trainer.scoring import RewardScorer, greedy_scores
from hybridrl.trainer.step_batch import StepBatch
from hybridrl.trainer.timer import PhaseTimer

if typing.TYPE_CHECKING:
    from hybridrl.pipeline.coordinator import Pipeline

PHASES = ("rollout", "log_probs", "advantages", "update", "refit")


@dataclass(frozen=True)
class BatchShape:
    """How big a step is, how its rows are padded, and the checks it runs (plain values from
    ``batch.*`` / ``rollout.*`` / ``trainer.*`` and the tokenizer)."""

    prompts_per_step: int
    samples_per_prompt: int  # rollout.n
    mini_batch_size: int  # responses per optimizer step
    epochs: int  # passes over the batch
    max_response_tokens: int  # rollout.max_tokens (DAPO overlong shaping)
    pad_id: int = 0  # the token id that pads rows
    exact: bool = False  # rollout.exact: the engine's log-probs are the trainer's bits (no recompute pass)
    exact_recompute: bool = False  # rollout.exact_recompute: recompute anyway, require equal bits
    mismatch_report_every: int = 0  # trainer.mismatch_report_every: log the gap every k steps

    @classmethod
    def from_config(cls, cfg: Config, pad_id: int) -> BatchShape:
        b, r = cfg.batch, cfg.rollout
        return cls(prompts_per_step=b.prompts_per_step, samples_per_prompt=r.n, mini_batch_size=b.mini_batch_size,
                   epochs=b.ppo_epochs, max_response_tokens=r.max_tokens, pad_id=pad_id,
                   exact=r.exact, exact_recompute=r.exact_recompute, mismatch_report_every=cfg.trainer.mismatch_report_every)

    @property
    def responses(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


class RLStep:
    """The components of a run and the order of one step over them."""

    def __init__(self, *, source: Pipeline, scorer: RewardScorer, actor: Actor, critic: Critic | None,
                 train_set: PromptSet, algo: AlgoConfig, shape: BatchShape, dp: DistContext | None = None):
        """``source``: where the step's batches come from and its weights go (``pipeline/``),
        whatever ``trainer.mode`` is."""
        self.source, self.scorer, self.actor, self.critic = source, scorer, actor, critic
        self.train_set, self.algo, self.shape = train_set, algo, shape
        self.reference: Reference | None = None
        self.kl_ctrl: algos.FixedKLController | algos.AdaptiveKLController | None = None
        self.dp = dp  # data parallel: this rank's share of every batch
        # rollout.exact: the engine samples under the trainer's batch-invariant numerics (the
        # built-in engine's exact layers, or the policy's own modules: hybridrl/exact), so its
        # log-probs *are* the old log-probs: no recompute pass
        self.exact = shape.exact
        self._steps_done = 0

    @property
    def rollout(self) -> RolloutWorker:
        """The trainer's own engine (eval and baselines read it through the source)."""
        return self.source.local

    def attach_reference(self, reference: Reference) -> None:
        """The KL reference (a frozen copy of the policy after the warm start) and its controller."""
        kl = self.algo.kl
        self.reference = reference
        if kl.adaptive_target is not None:
            self.kl_ctrl = algos.AdaptiveKLController(kl_coef=kl.coef, target_kl=kl.adaptive_target,
                                                      horizon=kl.horizon)
        else:
            self.kl_ctrl = algos.FixedKLController(kl_coef=kl.coef)

    def shard_for_data_parallel(self) -> None:
        """After the warm start: FSDP2-shard the actor (and reference, critic) and give them
        fresh optimizers over the shards (nothing is lost: RL has not stepped yet); from
        then on the rollout worker refits by gathering bucket by bucket."""
        from hybridrl.distributed.fsdp import shard_model
        from hybridrl.trainer import forward, shared_prefix

        routes = forward.fsdp_forward_methods() | shared_prefix.fsdp_forward_methods()
        shard_model(self.actor.model, routes)
        self.actor.reset_optimizer()
        if self.reference is not None and not self.reference.shares_policy:
            shard_model(self.reference.model, routes)
        if self.critic is not None:
            shard_model(self.critic.model)
            self.critic.reset_optimizer()

    def state_dict(self, *, optimizers: bool = True, source_states: list | None = None) -> dict:
        """What the step's components need for an exact resume besides their weights:
        optimizer and LR-schedule states (``optimizers=False``: a sharded run keeps the
        optimizer states in DCP), the actor's mini-batch shuffling generator, the KL
        coefficient, and the source's (the weight version, untrained groups) — with several
        ranks every rank's (``source_states``, gathered by the caller: each rank's source holds
        its own share). Each component writes its own part."""
        critic = None if self.critic is None else self.critic.state_dict() if optimizers else "dcp"
        return {"actor": self.actor.state_dict(optimizer=optimizers), "critic": critic,
                "kl_ctrl": None if self.kl_ctrl is None else self.kl_ctrl.state_dict(),
                "source": self.source.state_dict() if source_states is None else {"ranks": source_states}}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` into the built components (weights already loaded); the
        source's :meth:`start` then loads the restored policy into the engines as the saved version."""
        self.actor.load_state_dict(state["actor"])
        if self.critic is not None and isinstance(state["critic"], dict):
            self.critic.load_state_dict(state["critic"])
        if self.kl_ctrl is not None and state["kl_ctrl"] is not None:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if "source" not in state:
            raise ValueError("checkpoint.resume: the checkpoint was written by an older hybridrl (no batch-source "
                             "state); resume it with the version that wrote it, or start the run again")
        source = state["source"]
        if "ranks" in source:  # data parallel: this rank's own
            ranks = source["ranks"]
            world = self.dp.world_size if self.dp is not None else 1
            if len(ranks) != world:
                raise ValueError(f"checkpoint.resume: the checkpoint was written by {len(ranks)} ranks, this run has "
                                 f"{world}; resume with the same launcher ranks")
            source = ranks[self.dp.rank if self.dp is not None else 0]
        self.source.load_state_dict(source)

    def start(self, rng: random.Random, first_step: int) -> None:
        """Start generating with the current policy; step ``first_step`` trains next. The
        source draws the steps' prompts from ``rng`` exactly as :meth:`_draw` would."""
        self.source.start(self.actor.model, draw=self._draw, rng=rng, first_step=first_step)

    def fresh_rollout(self) -> RolloutWorker:
        """The trainer's engine holding the current policy (eval, ReMax baselines)."""
        return self.source.current_rollout(self.actor.model)

    def close(self) -> None:
        self.source.close()

    def needs_old_log_prob(self) -> bool:
        """Whether the step needs a separate no-grad log-prob pass before the update.

        It does not when the update is on-policy (one epoch over one mini-batch) and no
        correction reads the old log-probs first (TIS, sequence masking, KL in the reward):
        then the update's own forward gives them, and one forward pass per step is saved.
        """
        a, s = self.algo, self.shape
        off_policy = s.epochs > 1 or s.mini_batch_size < s.responses
        return (off_policy or a.correction.tis_cap is not None or a.correction.mismatch_seq_upper is not None
                or (a.kl.coef > 0 and not a.kl.use_loss))

    # ---- the recipe ---------------------------------------------------------------------
    def __call__(self, rng: random.Random | None = None) -> dict[str, float]:
        """One RL step; returns its metrics (phase seconds included). With ``rollout.exact``
        every forward of the step (sampling, log-probs, the update's) runs batch-invariant.
        (``rng`` is unused: the source drew the steps' prompts since :meth:`start`.)"""
        if not self.exact:
            return self._step()
        from hybridrl.exact import batch_invariant

        with batch_invariant():
            return self._step()

    def _step(self) -> dict[str, float]:
        timer, metrics = PhaseTimer(PHASES), {}
        with timer.phase("rollout"):  # generation still running, and scoring left after it
            batch = self.source.take(self.actor.model)
        sb = batch.step_batch
        self.shape_rewards(sb)
        metrics.update(batch.metrics)
        with timer.phase("log_probs"):
            metrics.update(self.log_probs(sb))
        with timer.phase("advantages"):
            metrics.update(self.advantages(sb))
            metrics.update(self.corrections(sb, stale=batch.stale))
        with timer.phase("update"):
            metrics.update(self.update(sb))
        with timer.phase("refit"):
            published = self.source.publish(self.actor.model)
        metrics["refit/bytes"] = float(published.bytes_moved)  # LoRA: the adapters (or merged targets) only
        metrics.update(step_metrics(sb, timer))
        metrics["refit/weight_version"] = published.version
        if self.dp is not None:
            metrics = self._global_metrics(metrics, sb)
        return metrics

    def _global_metrics(self, metrics: dict[str, float], sb: StepBatch) -> dict[str, float]:
        """Every rank's metrics averaged (equal rows per rank; losses are already global-batch
        normalized times dp_size, so their mean is the global loss); reward std over all rows
        (a rank's refill rounds may have given it more)."""
        from hybridrl.distributed.context import all_gather_values, all_reduce_metrics, union_of_keys

        everything = torch.tensor(all_gather_values(sb.raw_scores.float().cpu().tolist()))
        out = all_reduce_metrics(union_of_keys(metrics), summed=frozenset())
        out["reward/std"] = float(everything.std()) if everything.numel() > 1 else 0.0
        return out

    # ---- phases -------------------------------------------------------------------------
    def _draw(self, rng: random.Random) -> tuple[list[int], list[int]]:
        """This rank's prompts (training-set rows) and one seed per prompt."""
        batch_idx = rng.sample(range(len(self.train_set)), self.shape.prompts_per_step)
        seeds = [rng.randrange(2**62) for _ in batch_idx]
        if self.dp is not None:  # every rank draws the same batch and keeps its share of the groups
            share = self.dp.shard(len(batch_idx))
            batch_idx, seeds = batch_idx[share], seeds[share]
        return batch_idx, seeds

    def shape_rewards(self, sb: StepBatch) -> None:
        """DAPO's soft overlong penalty on top of the verifier scores, when configured."""
        d = self.algo.dapo
        if d.overlong_buffer_len > 0:
            sb.scores = sb.raw_scores + algos.overlong_reward_penalty(
                sb.rollouts.response_mask.sum(-1).cpu(), max_response_length=self.shape.max_response_tokens,
                overlong_buffer_len=d.overlong_buffer_len, overlong_penalty_factor=d.overlong_penalty_factor,
            ).to(sb.raw_scores.device)

    def log_probs(self, sb: StepBatch) -> dict[str, float]:
        """Old log-probs (only when needed, see :meth:`needs_old_log_prob`) and reference log-probs.
        With stale tokens the old log-probs are the proximal policy (the weights at the start
        of this update) that the decoupled objective clips around, the engine's the behaviour
        policy's; an on-policy-shaped update gets the proximal ones from its own forward."""
        ro, metrics = sb.rollouts, {}
        if self.exact:  # the engine's log-probs are the trainer's, bit for bit
            sb.tensors["old_log_prob"] = ro.logprobs.clone()
            if self.shape.exact_recompute:
                metrics.update(self._check_exact(sb))
        elif self.needs_old_log_prob():
            sb.tensors["old_log_prob"] = self._policy_log_probs(ro)
        self._steps_done += 1
        k = self.shape.mismatch_report_every
        if k and self._steps_done % k == 0:
            metrics.update(self._mismatch_metrics(sb))
        if self.reference is not None:
            vision = {} if ro.images is None else {"images": ro.images}
            ref = self.reference.log_probs(ro.input_ids, ro.attention_mask, ro.response_mask,
                                           routed_experts=ro.routed_experts, **vision)
            sb.tensors["ref_log_prob"] = ref
            # KL of the sampling policy to the reference (the engine's log-probs are the policy's)
            kl = algos.kl_penalty(ro.logprobs, ref, self.algo.kl.estimator)
            metrics["actor/kl"] = float(algos.masked_mean(kl, ro.response_mask))
        return metrics

    def _policy_log_probs(self, ro) -> torch.Tensor:
        """The current weights' no-grad log-probs ``[B, L]`` of the rows (the engine's routing
        replayed, the rows' images seen)."""
        vision = {} if ro.images is None else {"images": ro.images}
        return self.actor.compute_log_prob(ro.input_ids, ro.attention_mask, ro.response_mask,
                                           routed_experts=ro.routed_experts, **vision)[0]

    def _mismatch_metrics(self, sb: StepBatch) -> dict[str, float]:
        """trainer.mismatch_report_every: the gap between the rollout's log-probs and the
        trainer's (those of this step, or one extra no-grad pass), as hybridrl doctor reports it."""
        from hybridrl.algos.gap import token_gap

        ro = sb.rollouts
        old = sb.tensors.get("old_log_prob")
        if old is None:
            old = self._policy_log_probs(ro)
        g = token_gap(old, ro.logprobs, ro.response_mask)
        return {"mismatch/kl": g["kl"], "mismatch/max_abs": g["max_abs"], "mismatch/frac_over_1e-3": g["frac_over_1e-3"]}

    def _check_exact(self, sb: StepBatch) -> dict[str, float]:
        """rollout.exact_recompute: the old-log-prob pass, required equal to the rollout's bits;
        the recomputed values are the ones trained on (identical when the check passes)."""
        ro = sb.rollouts
        old = self._policy_log_probs(ro)
        mask = ro.response_mask.bool()
        differ = int((old[mask] != ro.logprobs[mask]).sum())
        if differ:
            worst = float((old[mask] - ro.logprobs[mask]).abs().max())
            raise RuntimeError(f"rollout.exact: {differ} of {int(mask.sum())} response tokens have other trainer "
                               f"log-probs than the rollout's (max |diff| {worst:.3g}); this machine or model breaks "
                               "batch invariance: report it, and run with rollout.exact=false meanwhile")
        sb.tensors["old_log_prob"] = old
        return {"actor/exact_mismatched_tokens": 0.0}

    def advantages(self, sb: StepBatch) -> dict[str, float]:
        """Token rewards (KL penalty in the reward if configured), then advantages and returns."""
        a, ro, metrics = self.algo, sb.rollouts, {}
        token_rewards = algos.scores_to_token_level_rewards(sb.scores, ro.response_mask)
        if self.reference is not None and not a.kl.use_loss:
            token_rewards, kl_m = algos.apply_kl_penalty(
                token_level_rewards=token_rewards, old_log_prob=sb.tensors["old_log_prob"],
                ref_log_prob=sb.tensors["ref_log_prob"], response_mask=ro.response_mask, kl_ctrl=self.kl_ctrl,
                kind=a.kl.estimator)
            metrics.update({f"actor/{k}": float(v) for k, v in kl_m.items()})
        sb.values = self.critic.values(sb.update_batch()) if self.critic is not None else None
        baselines = None
        if a.advantage.estimator == "remax":
            greedy = greedy_scores(self.fresh_rollout(), self.scorer, self.train_set.subset(sb.batch_idx))
            baselines = torch.tensor([greedy[i] for i in sb.index], dtype=torch.float32)
        fn = algos.get_adv_estimator(a.advantage.estimator)
        sb.tensors["advantages"], sb.returns = fn(
            token_level_rewards=token_rewards, response_mask=ro.response_mask, index=sb.index,
            norm_adv_by_std_in_grpo=a.advantage.norm_by_std, gamma=a.advantage.gamma, lam=a.advantage.lam,
            values=sb.values, reward_baselines=baselines)
        if self.actor.distiller is not None:  # on-policy distillation: the teacher's per-token signal
            sb.tensors["advantages"], distill_m = self.actor.distiller.advantages(
                sb.tensors["advantages"], ro, sb.tensors.pop("teacher_log_prob", None))
            metrics.update(distill_m)
        return metrics

    def corrections(self, sb: StepBatch, *, stale: bool = False) -> dict[str, float]:
        """Rollout/trainer mismatch (TIS weights, sequence masking), DAPO truncation masking, and
        for a batch with stale tokens (``stale``) the decoupled PPO weights: behaviour (the
        engine's per-token log-probs, whatever version sampled each token) -> proximal
        (``old_log_prob``), capped — the same weight as TIS, so ``tis_cap`` wins when set.
        Without an old-log-prob pass (an on-policy-shaped update) the update computes them
        from its own forward (``Actor.update(proximal_is_cap=...)``)."""
        c, ro, metrics = self.algo.correction, sb.rollouts, {}
        mask, old = ro.response_mask, sb.tensors.get("old_log_prob")
        cap = c.tis_cap if c.tis_cap is not None else c.decoupled_cap if stale and c.decoupled else None
        sb.proximal_is_cap = None
        if cap is not None and old is None:
            sb.proximal_is_cap = cap
        elif cap is not None:
            sb.tensors["rollout_is_weights"], m = algos.compute_tis_weights(old, ro.logprobs, mask, tis_cap=cap)
            metrics.update({f"actor/{k}": float(v) for k, v in m.items()})
            if stale:
                metrics.update(proximal_weights(old, ro.logprobs, mask, cap)[1])
        if c.mismatch_seq_upper is not None:
            mask, m = algos.compute_seq_mismatch_mask(old, ro.logprobs, mask, upper=c.mismatch_seq_upper,
                                                      lower=c.mismatch_seq_lower)
            metrics.update({f"actor/{k}": float(v) for k, v in m.items()})
        if self.algo.dapo.overlong_filter:
            mask, truncated = algos.mask_truncated_responses(mask, finish_reasons=ro.finish_reasons)
            metrics["batch/truncated_masked"] = float(truncated.float().mean())
        sb.loss_mask = mask
        return metrics

    def update(self, sb: StepBatch) -> dict[str, float]:
        """Actor (and critic) update on the kept rows (DAPO dynamic sampling drops flat groups)."""
        metrics, d = {}, self.algo.dapo
        keep = torch.arange(len(sb.index))
        ranks = self.dp.world_size if self.dp is not None else 1  # each rank steps on its share
        if d.dynamic_sampling:
            keep = algos.dynamic_sampling_keep(sb.raw_scores, sb.index)
            metrics["batch/kept_fraction"] = len(keep) / len(sb.index)
            if d.refill_rounds > 0:  # DAPO trains on a full batch of kept groups
                keep = keep[: self.shape.responses // ranks]
            if self.dp is not None:  # as many rows on every rank: the sharded update steps together
                from hybridrl.distributed.context import all_reduce_min

                keep = keep[: all_reduce_min(len(keep))]
        if len(keep) == 0:
            return metrics
        kept = sb.update_batch(keep)
        metrics.update(self.actor.update(kept, mini_batch_size=min(self.shape.mini_batch_size // ranks, len(keep)),
                                         epochs=self.shape.epochs, proximal_is_cap=sb.proximal_is_cap))
        if self.critic is not None:
            metrics.update(self.critic.update({**kept, "returns": sb.returns[keep], "values": sb.values[keep]}))
        return metrics


def flat_group_fraction(scores: torch.Tensor, index: list[int]) -> float:
    """Share of groups whose rewards are all equal (zero advantage under GRPO: no signal)."""
    groups: dict[int, list[float]] = {}
    for s, g in zip(scores.tolist(), index):
        groups.setdefault(g, []).append(s)
    return sum(max(v) == min(v) for v in groups.values()) / max(len(groups), 1)


def step_metrics(sb: StepBatch, timer: PhaseTimer) -> dict[str, float]:
    ro, raw = sb.rollouts, sb.raw_scores
    n_tokens = float(ro.response_mask.sum())
    out = {
        "reward/mean": float(raw.mean()), "reward/std": float(raw.std()) if raw.numel() > 1 else 0.0,
        "reward/failures": float(sb.failures),
        "reward/failure_rate": sb.failures / max(raw.numel(), 1),
        "batch/flat_group_fraction": flat_group_fraction(raw, sb.index),
        "response/length_mean": float(ro.response_mask.sum(-1).float().mean()),
        "response/truncated_fraction": sum(f == "length" for f in ro.finish_reasons) / len(ro.finish_reasons),
        "rollout/weight_version": ro.weight_version,
        "perf/tokens_per_s": n_tokens / max(timer.total, 1e-9),
        "perf/rollout_tokens_per_s": n_tokens / max(timer.seconds["rollout"], 1e-9),
    }
    out.update({f"time/{k}_s": v for k, v in timer.seconds.items()})
    out.update({f"reward/{k}": v for k, v in sb.extras.items()})
    out.update(sb.episode_metrics)
    return out
