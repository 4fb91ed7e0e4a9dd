"""Loss aggregation ``agg_loss``: a per-token loss matrix → one scalar, correct under
gradient accumulation and data parallelism.

Why the ``GlobalBatchInfo``: an optimizer step consumes one *mini-batch*, which the loop
splits into micro-batches (gradient accumulation) and across data-parallel ranks. If each
micro-batch normalized by its own token count, a micro-batch of 3 tokens would weigh as
much as one of 300, and the accumulated gradient would depend on how the batch was cut.
So the normalizer is the mini-batch's, counted once before the first micro-batch:

    info = GlobalBatchInfo.from_masks([mb.response_mask for mb in micro_batches], dp_group=...)
    for mb in micro_batches:
        loss, _ = policy_loss(..., response_mask=mb.response_mask, global_batch_info=info)
        loss.backward()                       # summed, never divided by the number of micro-batches

Data-parallel backends (DDP, FSDP) *average* gradients over ranks; ``agg_loss`` multiplies
by ``dp_size`` to cancel that average, so that the step's gradient equals the gradient of
the loss over the whole global mini-batch — exactly, for every mode, however it is split.
Without ``global_batch_info`` the batch passed in is the whole mini-batch (one call, one rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .masked import masked_sum
from .registry import check_choice

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True, kw_only=True)
class GlobalBatchInfo:
    """Normalizers of one optimizer step's mini-batch, over all micro-batches and all ranks."""

    global_tokens: float  # Σ loss_mask over the mini-batch (response tokens that count)
    global_seqs: float  # rows with at least one such token
    dp_size: int = 1  # data-parallel ranks whose gradients the backend averages

    def __post_init__(self):
        if self.global_tokens < 0 or self.global_seqs < 0 or self.dp_size < 1:
            raise ValueError(f"GlobalBatchInfo{(self.global_tokens, self.global_seqs, self.dp_size)}: "
                             "counts must be >= 0 and dp_size >= 1; build it with GlobalBatchInfo.from_masks")

    @classmethod
    def from_masks(cls, loss_masks: Sequence[torch.Tensor], *, dp_group=None) -> "GlobalBatchInfo":
        """Count this rank's micro-batch masks ``[b, L]`` and all-reduce over ``dp_group`` when
        ``torch.distributed`` is initialized (one collective per mini-batch)."""
        counts = torch.zeros(2, dtype=torch.float64, device=loss_masks[0].device)
        for mask in loss_masks:
            counts[0] += mask.to(torch.float64).sum()
            counts[1] += (mask.to(torch.float64).sum(-1) > 0).sum()
        dp_size = 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts, group=dp_group)
            dp_size = torch.distributed.get_world_size(dp_group)
        tokens, seqs = counts.tolist()
        return cls(global_tokens=tokens, global_seqs=seqs, dp_size=dp_size)


@dataclass(frozen=True, kw_only=True)
class LossAggregation:
    """How a loss reduces its per-token matrix to a scalar: the arguments of ``agg_loss``
    that travel together from the loop into every loss (``mode`` is ``agg_loss``'s
    ``loss_agg_mode``; ``global_batch_info``, ``loss_scale_factor`` as there)."""

    mode: str = "token-mean"  # one of LOSS_AGG_MODES (algo.loss_agg_mode)
    global_batch_info: GlobalBatchInfo | None = None  # the mini-batch's normalizers; None = this batch is all
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's constant C (max response length)

    def __call__(self, loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """``agg_loss(loss_mat [B, L], loss_mask [B, L], mode, ...)`` → scalar."""
        return agg_loss(loss_mat, loss_mask, self.mode, global_batch_info=self.global_batch_info,
                        loss_scale_factor=self.loss_scale_factor)


def _at_least_one(count):
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(float(count), 1.0)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str = "token-mean", *,
             global_batch_info: GlobalBatchInfo | None = None, loss_scale_factor: float | None = None) -> torch.Tensor:
    """Aggregate ``loss_mat [B, L]`` over ``loss_mask [B, L]`` (0/1) into a scalar.

    With N_tok = Σ mask, N_seq = #rows with a masked-in token, n_i = Σ_t mask_{i,t}
    (N_tok, N_seq from ``global_batch_info`` when given, times its ``dp_size``):

    - ``token-mean``              Σ_{i,t} ℓ / N_tok                  (DAPO token-level loss, arXiv:2503.14476)
    - ``token-sum``               Σ_{i,t} ℓ
    - ``seq-mean-token-sum``      Σ_i (Σ_t ℓ) / N_seq
    - ``seq-mean-token-mean``     Σ_i (Σ_t ℓ / n_i) / N_seq          (original GRPO, arXiv:2402.03300)
    - ``seq-mean-token-sum-norm`` Σ_i (Σ_t ℓ / C) / N_seq            (Dr. GRPO, arXiv:2503.20783)
      with the constant C = ``loss_scale_factor`` (the max response length): required.
      Note: verl divides by C only (not by N_seq): its loss is N_seq times ours.

    An empty mask gives 0 (with a graph, so ``backward`` still works).
    """
    check_choice(loss_agg_mode, LOSS_AGG_MODES, "algo.loss_agg_mode", "loss aggregation mode")
    mask = loss_mask.to(loss_mat.dtype)
    if global_batch_info is None:
        n_tok, n_seq, dp_size = mask.sum(), (mask.sum(-1) > 0).sum().to(loss_mat.dtype), 1
    else:
        info = global_batch_info
        n_tok, n_seq, dp_size = info.global_tokens, info.global_seqs, info.dp_size
    n_tok, n_seq = _at_least_one(n_tok), _at_least_one(n_seq)  # exact for integer counts; empty mask → 0

    if loss_agg_mode == "token-mean":
        loss = masked_sum(loss_mat, loss_mask) / n_tok
    elif loss_agg_mode == "token-sum":
        loss = masked_sum(loss_mat, loss_mask)
    elif loss_agg_mode == "seq-mean-token-sum":
        loss = masked_sum(loss_mat, loss_mask) / n_seq
    elif loss_agg_mode == "seq-mean-token-mean":
        per_seq = masked_sum(loss_mat, loss_mask, dim=-1) / mask.sum(-1).clamp(min=1)
        loss = per_seq.sum() / n_seq
    else:  # seq-mean-token-sum-norm
        if loss_scale_factor is None or loss_scale_factor <= 0:
            raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs a constant loss_scale_factor > 0 "
                             "(Dr. GRPO: the max response length, rollout.max_tokens)")
        loss = masked_sum(loss_mat, loss_mask) / (n_seq * loss_scale_factor)
    return loss * dp_size
