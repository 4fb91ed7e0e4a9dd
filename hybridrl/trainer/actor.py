"""The actor: a Hugging Face causal LM, its optimizer, and the policy-gradient update.

An update splits the rollout batch into mini-batches (one optimizer step each) and each
mini-batch into micro-batches by a token budget (length-sorted). Loss normalizers are
the mini-batch's (``GlobalBatchInfo``), so gradient accumulation gives the gradient of
the whole mini-batch, whatever the micro-batch split.
"""

from __future__ import annotations

import math
import torch

from hybridrl import algos
from hybridrl.attention.packing import make_microbatches, padding_fraction
from hybridrl.algos.metrics import accumulate, is_extreme
from hybridrl.config import AlgoConfig, BatchConfig, Config, OptimConfig
from hybridrl.trainer.balance_loss import router_load_balancing_loss
from hybridrl.trainer.forward import ForwardOptions, MoEForward, compute_logprobs_entropy
from hybridrl.trainer.logprobs import logprobs_in_microbatches, trim_padding_columns
from hybridrl.trainer.shared_prefix import prefix_cache_expandable, shared_prefix_logprobs_entropy
from hybridrl.trainer.teacher import Distiller
from hybridrl.trainer.vision_forward import vision_tokens_of
from hybridrl.trainer.vision_model import freeze_vision_tower


def scalar(t: torch.Tensor) -> float:
    """A 0-dim tensor as a float; a DTensor (FSDP2's global grad norm) is gathered first."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def make_adamw(params, **kwargs) -> torch.optim.AdamW:
    """AdamW, fused where this torch build supports it (one kernel for all parameters:
    4.5 ms -> 1.5 ms a step for the default 0.5M-parameter model on CPU)."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, **kwargs)


def warmup_lambda(warmup_steps: int):
    return lambda step: min(1.0, (step + 1) / max(1, warmup_steps))


class Actor:
    """The policy being trained: ``model`` (an HF causal LM), its AdamW and LR schedule,
    and the policy-gradient update with its loss configuration.

    ``algo`` is the run's ``algo`` group (not a copy): its ``policy_loss``, ``kl``,
    ``router_aux_loss_coef`` and ``loss_agg_mode`` (which aggregates every term: policy,
    KL, entropy);
    ``loss_scale_factor`` is seq-mean-token-sum-norm's constant (the max response length);
    ``temperature`` is the sampling temperature the log-probs are taken at.
    """

    def __init__(self, model: torch.nn.Module, *, optim: OptimConfig, algo: AlgoConfig, temperature: float,
                 loss_scale_factor: float | None = None, batch: BatchConfig | None = None, seed: int = 0,
                 distiller: Distiller | None = None):
        """``batch``: the token budget per micro-batch and whether groups share their prompt's
        forward (``batch.max_tokens_per_microbatch``, ``batch.shared_prefix``); ``distiller``:
        on-policy distillation (``algo.distill``), whose divergence term this update adds in
        ``mode=loss`` and whose advantages the step reads in ``mode=advantage``."""
        batch = batch if batch is not None else BatchConfig()
        self.model = model
        self.distiller = distiller
        self.generator = torch.Generator().manual_seed(seed)  # mini-batch shuffling (its state is resumed)
        self.policy_loss, self.kl = algo.policy_loss, algo.kl
        self.loss_agg_mode, self.loss_scale_factor = algo.loss_agg_mode, loss_scale_factor
        self.temperature = temperature
        self.shared_prefix = batch.shared_prefix
        self.router_aux_loss_coef = algo.router_aux_loss_coef  # MoE load balancing (Switch Transformer), 0 = off
        self.grad_clip = optim.grad_clip
        self.max_tokens = batch.max_tokens_per_microbatch
        self._optim = optim
        self.reset_optimizer()

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg: Config, distiller: Distiller | None = None) -> Actor:
        """The run's actor over ``model`` (``optim``, ``algo``, ``batch``, ``rollout`` groups; a
        VL model's vision tower frozen first with ``model.freeze_vision``)."""
        if cfg.model.freeze_vision:
            freeze_vision_tower(model)
        return cls(model, optim=cfg.optim, algo=cfg.algo, temperature=cfg.rollout.temperature,
                   loss_scale_factor=float(cfg.rollout.max_tokens), batch=cfg.batch, seed=cfg.trainer.seed,
                   distiller=distiller)

    def reset_optimizer(self) -> None:
        """A fresh AdamW and LR schedule over the model's current trainable parameters (after
        FSDP2 sharding replaced them with DTensor shards; with LoRA: the adapters only)."""
        optim = self._optim
        self.optimizer = make_adamw([p for p in self.model.parameters() if p.requires_grad], lr=optim.lr, betas=tuple(optim.betas),
                                    weight_decay=optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_lambda(optim.warmup_steps))

    def _micro(self, lengths: torch.Tensor) -> list[list[int]]:
        return make_microbatches(lengths.tolist(), self.max_tokens)

    def state_dict(self, *, optimizer: bool = True) -> dict:
        """Optimizer, LR-schedule and shuffling-generator state (the weights are saved in HF format);
        ``optimizer=False``: the schedule only (a sharded run keeps the optimizer in DCP)."""
        state = {"scheduler": self.scheduler.state_dict(), "shuffle": self.generator.get_state()}
        if optimizer:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["shuffle"])

    @torch.no_grad()
    def compute_log_prob(self, input_ids, attention_mask, response_mask, *, with_entropy: bool = False,
                         routed_experts=None, images=None):
        """Log-probs ``[B, L]`` float32 (and entropy) of the current weights, no grad
        (``routed_experts``: MoE expert choices of the engine to replay; ``images``: a VL
        batch's ``RowImages``)."""
        return logprobs_in_microbatches(self.model, input_ids, attention_mask, response_mask,
                                        temperature=self.temperature, max_tokens=self.max_tokens,
                                        routed_experts=routed_experts, images=images,
                                        with_entropy=with_entropy)

    def update(self, batch: dict[str, torch.Tensor], *, mini_batch_size: int, epochs: int,
               proximal_is_cap: float | None = None) -> dict[str, float]:
        """PPO-style epochs over mini-batches shuffled by the actor's own generator. ``batch`` holds ``[N, L]`` tensors:
        input_ids, attention_mask, response_mask, advantages, and optionally old_log_prob
        (absent = on-policy: one epoch over one mini-batch), ref_log_prob,
        rollout_log_prob, rollout_is_weights; a VL batch also ``images`` (``RowImages``).

        ``proximal_is_cap`` (stale tokens, no old-log-prob pass): the decoupled weights
        ``min(exp(logp_prox - rollout_log_prob), cap)`` from the update's own forward — with
        one epoch over one mini-batch the weights at the start of the update *are* the ones
        being updated, so that forward is the proximal policy and no separate pass is needed."""
        if proximal_is_cap is not None and ("old_log_prob" in batch or "rollout_is_weights" in batch):
            raise ValueError("Actor.update: proximal_is_cap is for an update without old_log_prob / "
                             "rollout_is_weights (their pass already gives the weights)")
        if "old_log_prob" not in batch and (epochs > 1 or mini_batch_size < batch["input_ids"].shape[0]):
            raise ValueError("Actor.update: without old_log_prob the update must be one epoch over one "
                             "mini-batch (on-policy); compute old log-probs first")
        self.model.train()
        n = batch["input_ids"].shape[0]
        sums: dict[str, float] = {}
        steps = 0
        for _ in range(epochs):
            order = torch.randperm(n, generator=self.generator)
            for start in range(0, n, mini_batch_size):
                idx = order[start:start + mini_batch_size]
                accumulate(sums, self._mini_batch_step({k: v[idx] for k, v in batch.items()}, proximal_is_cap))
                steps += 1
        out = {k: v if is_extreme(k) else v / max(steps, 1) for k, v in sums.items()}
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def _mini_batch_step(self, mb: dict[str, torch.Tensor], proximal_is_cap: float | None = None):
        pl, kl, temperature = self.policy_loss, self.kl, self.temperature
        lengths = mb["attention_mask"].sum(-1)
        # Shared-prefix forward when rows carry their group and the mini-batch is one
        # micro-batch (groups must stay together); else token-budgeted padded micro-batches.
        # (MoE replay, the router loss and VL images need every token through the plain packed forward)
        moe_extras = "routed_experts" in mb or self.router_aux_loss_coef > 0
        shared = (self.shared_prefix and not moe_extras and "group" in mb and vision_tokens_of(self.model) is None
                  and int(lengths.sum()) <= self.max_tokens and prefix_cache_expandable(self.model))
        micros = [list(range(len(lengths)))] if shared else self._micro(lengths)
        masks = [mb["response_mask"][m] for m in micros]
        info = algos.GlobalBatchInfo.from_masks(masks)
        agg = dict(loss_agg_mode=self.loss_agg_mode, global_batch_info=info, loss_scale_factor=self.loss_scale_factor)
        self.optimizer.zero_grad(set_to_none=True)
        policy_loss_fn = algos.get_policy_loss(pl.name)
        clip = algos.ClipRange(low=pl.clip_ratio_low, high=pl.clip_ratio_high, c=pl.clip_ratio_c)
        aggregation = algos.LossAggregation(mode=self.loss_agg_mode, global_batch_info=info,
                                            loss_scale_factor=self.loss_scale_factor)
        acc: dict[str, float] = {}
        weights = [float(m.sum()) for m in masks]
        total_w = max(sum(weights), 1.0)
        for rows, w in zip(micros, weights):
            micro = trim_padding_columns({k: v[rows] for k, v in mb.items()})
            if shared:
                log_prob, entropy = shared_prefix_logprobs_entropy(
                    self.model, micro["input_ids"], micro["attention_mask"], micro["response_mask"],
                    micro["prompt_len"], micro["group"], temperature=temperature)
            else:
                moe = (MoEForward(routed_experts=micro.get("routed_experts"),
                                  router_logits=[] if self.router_aux_loss_coef > 0 else None)
                       if moe_extras else None)
                log_prob, entropy = compute_logprobs_entropy(
                    self.model, micro["input_ids"], micro["attention_mask"], micro["response_mask"],
                    options=ForwardOptions(temperature=temperature, compute_entropy=True), moe=moe,
                    images=micro.get("images"))
            # On-policy fast path: without a separate old-log-prob pass, the policy that
            # sampled is the one being updated, so old = current (detached), ratio = 1.
            old_log_prob = micro.get("old_log_prob", log_prob.detach())
            is_weights, is_metrics = micro.get("rollout_is_weights"), {}
            if proximal_is_cap is not None:
                is_weights, is_metrics = proximal_weights(old_log_prob, micro["rollout_log_prob"],
                                                          micro["response_mask"], proximal_is_cap)
            pg_loss, pg_metrics = policy_loss_fn(
                old_log_prob=old_log_prob, log_prob=log_prob, advantages=micro["advantages"],
                response_mask=micro["response_mask"], clip=clip,
                rollout_is_weights=is_weights, aggregation=aggregation)
            loss = pg_loss
            metrics = {f"actor/{k}": float(v) * w / total_w for k, v in pg_metrics.items()}
            metrics.update({k: v * w / total_w for k, v in is_metrics.items()})
            metrics["actor/pg_loss"] = float(pg_loss.detach())
            ent = algos.entropy_bonus(entropy, micro["response_mask"], **agg)
            metrics["actor/entropy"] = float(ent.detach())
            if pl.entropy_coeff:
                loss = loss - pl.entropy_coeff * ent
            if "rollout_log_prob" in micro:
                diff = algos.agg_loss((log_prob.detach() - micro["rollout_log_prob"]).abs(), micro["response_mask"],
                                      **agg)
                metrics["rollout/trainer_logprob_abs_diff"] = float(diff)
                # the mean hides a few tokens off by a nat; the worst token is what a bound should see
                inside = micro["response_mask"].bool()
                metrics["rollout/trainer_logprob_abs_diff_max"] = float(
                    (log_prob.detach() - micro["rollout_log_prob"]).abs()[inside].max()) if inside.any() else 0.0
            if kl.coef and kl.use_loss and "ref_log_prob" in micro:
                kl_loss, _ = algos.compute_kl_loss(log_prob=log_prob, ref_log_prob=micro["ref_log_prob"],
                                                   response_mask=micro["response_mask"], kind=kl.estimator, **agg)
                loss = loss + kl.coef * kl_loss
                metrics["actor/kl_loss"] = float(kl_loss.detach())
            if self.distiller is not None and self.distiller.as_loss:
                distill = self.distiller.loss(self.model, micro, aggregation)
                loss = loss + distill
                metrics["distill/jsd_loss"] = float(distill.detach())
            if self.router_aux_loss_coef > 0 and not shared:
                aux = router_load_balancing_loss(self.model, moe.router_logits)
                loss = loss + self.router_aux_loss_coef * aux * (w / total_w)  # this micro-batch's share
                metrics["actor/router_aux_loss"] = float(aux.detach()) * w / total_w
            loss.backward()
            accumulate(acc, metrics)
        grad_norm = scalar(torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                                                          self.grad_clip))
        finite = math.isfinite(grad_norm)
        if finite:  # a non-finite loss or gradient skips the optimizer step (counted by the loop)
            self.optimizer.step()
        acc["actor/nonfinite_skipped"] = 0.0 if finite else 1.0
        self.scheduler.step()
        acc["actor/grad_norm"] = grad_norm
        acc["actor/padding_fraction"] = padding_fraction(lengths.tolist(), micros)
        return acc


def proximal_weights(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                     cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO's per-token importance weights behaviour -> proximal, ``[B, L]``
    (0 outside ``mask``, capped at ``cap``), and their statistics before the cap (the
    ``async/is_*`` metrics). All inputs ``[B, L]``, the log-probs float32."""
    ratio = torch.exp(proximal - behaviour)
    inside = mask.bool()
    r = ratio[inside]
    if r.numel() == 0:
        return torch.zeros_like(ratio), {}
    stats = {"async/is_weight_mean": float(r.mean()), "async/is_weight_max": float(r.max()),
             "async/is_weight_min": float(r.min()), "async/is_capped_fraction": float((r > cap).float().mean())}
    return torch.where(inside, ratio.clamp(max=cap), 0.0), stats
