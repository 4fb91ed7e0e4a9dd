"""The reference policy: a frozen copy of the actor (after the warm start) for the KL term."""

from __future__ import annotations

import copy

import torch

from hybridrl.trainer.logprobs import logprobs_in_microbatches


class Reference:
    def __init__(self, model: torch.nn.Module, *, temperature: float, max_tokens_per_microbatch: int):
        self.model = model
        self.temperature, self.max_tokens = temperature, max_tokens_per_microbatch

    @classmethod
    def frozen_copy_of(cls, policy: torch.nn.Module, **kwargs) -> "Reference":
        """A no-grad, eval-mode deep copy of ``policy``."""
        ref = copy.deepcopy(policy).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return cls(ref, **kwargs)

    @torch.no_grad()
    def log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  response_mask: torch.Tensor, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, L]`` float32 log-probs of the reference, aligned like ``Rollouts.logprobs``
        (MoE: with the engine's expert choices replayed when ``routed_experts`` is given)."""
        lp, _ = logprobs_in_microbatches(self.model, input_ids, attention_mask, response_mask,
                                         temperature=self.temperature, max_tokens=self.max_tokens,
                                         routed_experts=routed_experts)
        return lp
