"""The reference policy for the KL term: a frozen copy of the actor after the warm start,
or — with LoRA — the actor itself with its adapters switched off (no second copy)."""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch

from hybridrl.data.vision import RowImages
from hybridrl.trainer.logprobs import logprobs_in_microbatches


class Reference:
    def __init__(self, model: torch.nn.Module, *, temperature: float, max_tokens_per_microbatch: int,
                 adapter_off: Callable[[], contextlib.AbstractContextManager] | None = None):
        """``adapter_off``: a LoRA policy's ``adapter_disabled``; ``model`` is then the policy
        itself, computed as its base (nothing is copied, sharded or saved for it)."""
        self.model = model
        self.temperature, self.max_tokens = temperature, max_tokens_per_microbatch
        self.adapter_off = adapter_off

    @property
    def shares_policy(self) -> bool:
        """True when the reference is the policy's base (LoRA): it owns no weights."""
        return self.adapter_off is not None

    @classmethod
    def frozen_copy_of(cls, policy: torch.nn.Module, **kwargs) -> "Reference":
        """A no-grad, eval-mode deep copy of ``policy``."""
        ref = copy.deepcopy(policy).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return cls(ref, **kwargs)

    @torch.no_grad()
    def log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  response_mask: torch.Tensor, routed_experts: torch.Tensor | None = None,
                  images: RowImages | None = None) -> torch.Tensor:
        """``[B, L]`` float32 log-probs of the reference, aligned like ``Rollouts.logprobs``
        (MoE: with the engine's expert choices replayed when ``routed_experts`` is given;
        VL: with each row's ``images``)."""
        with self.adapter_off() if self.adapter_off is not None else contextlib.nullcontext():
            lp, _ = logprobs_in_microbatches(self.model, input_ids, attention_mask, response_mask,
                                             temperature=self.temperature, max_tokens=self.max_tokens,
                                             routed_experts=routed_experts, images=images)
        return lp
