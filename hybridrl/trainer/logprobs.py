"""No-grad log-probs of a whole batch in token-budgeted micro-batches (old and reference
log-probs), and the column trim every micro-batch gets."""

from __future__ import annotations

import torch

from hybridrl.attention.packing import make_microbatches
from hybridrl.trainer.forward import ForwardOptions, MoEForward, compute_logprobs_entropy


def trim_padding_columns(micro: dict) -> dict:
    """Drop columns that are padding in every row of the micro-batch (rows are right-padded);
    per-row values that are not tensors (``RowImages``) pass through."""
    L = int(micro["attention_mask"].sum(-1).max())
    return {k: (v[:, :L] if isinstance(v, torch.Tensor) and v.dim() >= 2 else v)
            for k, v in micro.items()}  # [B, L] and [B, L, layers, k]


@torch.no_grad()
def logprobs_in_microbatches(model, input_ids, attention_mask, response_mask, *, temperature: float,
                             max_tokens: int, with_entropy: bool = False, **per_row):
    """Token-budgeted no-grad log-probs (and entropy) ``[B, L]`` float32 for a whole batch.
    ``per_row`` (None = absent): ``routed_experts [B, L, layers, k]``, MoE expert choices to
    replay (see forward.MoEForward); ``images``, a VL batch's ``RowImages`` (see
    forward.compute_logprobs_entropy)."""
    unknown = set(per_row) - {"routed_experts", "images"}
    if unknown:
        raise TypeError(f"logprobs_in_microbatches: unexpected arguments {sorted(unknown)}")
    routed_experts, images = per_row.get("routed_experts"), per_row.get("images")
    B, L = input_ids.shape
    logprobs = torch.zeros(B, L, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(logprobs) if with_entropy else None
    was_training = model.training
    model.eval()
    for rows in make_microbatches(attention_mask.sum(-1).tolist(), max_tokens):
        micro = {"input_ids": input_ids[rows], "attention_mask": attention_mask[rows],
                 "response_mask": response_mask[rows]}
        if routed_experts is not None:
            micro["routed_experts"] = routed_experts[rows]
        if images is not None:
            micro["images"] = images[rows]
        micro = trim_padding_columns(micro)
        moe = MoEForward(routed_experts=micro["routed_experts"]) if routed_experts is not None else None
        lp, ent = compute_logprobs_entropy(model, micro["input_ids"], micro["attention_mask"],
                                           micro["response_mask"], moe=moe, images=micro.get("images"),
                                           options=ForwardOptions(temperature=temperature,
                                                                  compute_entropy=with_entropy))
        width = lp.shape[1]
        logprobs[rows, :width] = lp
        if with_entropy:
            entropy[rows, :width] = ent
    model.train(was_training)
    return logprobs, entropy
