"""The critic (PPO with GAE): a value model, its optimizer, and the clipped value-loss
update — the same shape as the Actor, aggregating with the run's ``loss_agg_mode``."""

from __future__ import annotations

import torch

from hybridrl import algos
from hybridrl.attention.packing import make_microbatches
from hybridrl.config import Config, OptimConfig, ValueConfig
from hybridrl.trainer.actor import scalar
from hybridrl.trainer.value_model import ValueModel


class Critic:
    """``model`` predicts ``values [B, L]`` aligned with ``response_mask`` (see value_model.py).

    ``loss_agg_mode`` is the run's ``algo.loss_agg_mode`` (the same key the Actor reads);
    ``loss_scale_factor`` is seq-mean-token-sum-norm's constant.
    """

    def __init__(self, model: ValueModel, *, optim: OptimConfig, value: ValueConfig, loss_agg_mode: str,
                 loss_scale_factor: float | None = None, max_tokens_per_microbatch: int = 8192):
        self.model = model
        self.cliprange = value.cliprange
        self.loss_agg_mode, self.loss_scale_factor = loss_agg_mode, loss_scale_factor
        self.grad_clip = optim.grad_clip
        self.max_tokens = max_tokens_per_microbatch
        self._optim = optim
        self.reset_optimizer()

    @classmethod
    def from_config(cls, cfg: Config, hf_config, device: torch.device) -> Critic:
        """A fresh value model shaped like the policy (``hf_config``), in ``model.dtype``,
        seeded by ``trainer.seed``, with the run's ``optim`` / ``algo`` / ``batch`` settings."""
        model = ValueModel.from_config(hf_config, dtype=cfg.model.torch_dtype, seed=cfg.trainer.seed).to(device)
        return cls(model, optim=cfg.optim, value=cfg.algo.value, loss_agg_mode=cfg.algo.loss_agg_mode,
                   loss_scale_factor=float(cfg.rollout.max_tokens),
                   max_tokens_per_microbatch=cfg.batch.max_tokens_per_microbatch)

    def state_dict(self) -> dict:
        """The optimizer state (the weights are saved with the model)."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    def reset_optimizer(self) -> None:
        """A fresh AdamW over the model's current parameters (after FSDP2 sharding)."""
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self._optim.critic_lr,
                                           betas=tuple(self._optim.betas))

    @torch.no_grad()
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Old values ``[B, L]`` (0 outside the response), in token-budget micro-batches."""
        self.model.eval()
        out = torch.zeros_like(batch["response_mask"])
        lengths = batch["attention_mask"].sum(-1).tolist()
        for rows in make_microbatches(lengths, self.max_tokens):
            width = max(lengths[i] for i in rows)
            v = self.model.values(batch["input_ids"][rows, :width], batch["attention_mask"][rows, :width])
            out[rows, :width] = v * batch["response_mask"][rows, :width]
        return out

    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step of clipped value regression over the batch (``input_ids``,
        ``attention_mask``, ``response_mask``, ``returns``, ``values`` ``[B, L]``),
        accumulated over token-budget micro-batches with the whole batch's normalizer."""
        self.model.train()
        lengths = batch["attention_mask"].sum(-1).tolist()
        micros = make_microbatches(lengths, self.max_tokens)
        info = algos.GlobalBatchInfo.from_masks([batch["response_mask"][m] for m in micros])
        self.optimizer.zero_grad(set_to_none=True)
        total, clipfrac = 0.0, 0.0
        for rows in micros:
            width = max(lengths[i] for i in rows)
            mb = {k: v[rows, :width] for k, v in batch.items() if v.dim() == 2}
            vpreds = self.model.values(mb["input_ids"], mb["attention_mask"])
            loss, m = algos.compute_value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"],
                                               cliprange_value=self.cliprange, loss_agg_mode=self.loss_agg_mode,
                                               global_batch_info=info, loss_scale_factor=self.loss_scale_factor)
            loss.backward()
            total += float(loss.detach())
            clipfrac += float(m["vf_clipfrac"]) * len(rows) / len(lengths)
        gn = scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        self.optimizer.step()
        return {"critic/vf_loss": total, "critic/grad_norm": gn, "critic/vf_clipfrac": clipfrac}
