"""The sparse MoE block of Qwen3-MoE / Qwen2-MoE in the inference layout.

Module names mirror transformers' ``Qwen3MoeSparseMoeBlock`` (``mlp.gate`` router,
``mlp.experts`` fused experts; Qwen2-MoE adds ``mlp.shared_expert`` and
``mlp.shared_expert_gate``), so HF names map to ours without a table:

- ``mlp.gate.weight [E, H]``: the router, a plain linear kept **unquantized** whatever the
  quantization (as in FP8 Qwen3-MoE checkpoints; routing is where small errors flip choices);
- ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``mlp.experts.down_proj [E, H, I]`` (or the
  per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``): ``layers/fused_moe.py``;
- Qwen2-MoE: ``mlp.shared_expert.{gate,up,down}_proj`` (a dense gated MLP, fused gate_up like
  every dense MLP) and ``mlp.shared_expert_gate.weight [1, H]``.

Routing is transformers' exactly: ``softmax(router_logits, float32)``, ``topk`` (sorted),
renormalized when ``norm_topk_prob``, weights cast to the hidden dtype; an expert's output
is ``down(silu(gate(x)) * up(x))`` times its weight, summed over the k experts.

Routing record (``hybridrl/rollout/routing.py``): a block that has a ``routing_buffer``
copies the decode step's top-k expert ids into it (a static tensor, so a captured CUDA
graph writes it on every replay); during a recorded prefill it keeps a reference to the
prefill's ids (``last_routing``; prefill is never graphed).
"""
from __future__ import annotations

import torch
from torch import nn

from hybridrl.rollout.layers.attention import ForwardContext
from hybridrl.rollout.layers.fused_moe import FusedExperts, FusedMoEMethodBase
from hybridrl.rollout.layers.linear import ReplicatedLinear
from hybridrl.rollout.layers.linear_method import UnquantizedLinearMethod
from hybridrl.rollout.model_config import ModelConfig

ROUTING_DTYPE = torch.int16  # expert ids as recorded (E <= 32767)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits ``[T, E]`` -> (topk_ids ``[T, k]`` int64, topk_weights ``[T, k]`` in the logits dtype)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(router_logits.dtype)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_index: int, moe_method: FusedMoEMethodBase, dtype, device, prefix: str,
                 shared_expert: nn.Module | None = None):
        super().__init__()
        H, E = cfg.hidden_size, cfg.num_experts
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.moe_index = moe_index
        """position of this block among the model's MoE layers (the routing record's layer axis)."""
        self.gate = ReplicatedLinear(H, E, bias=False, method=UnquantizedLinearMethod(), dtype=dtype,
                                     device=device, prefix=f"{prefix}.gate")
        self.experts = FusedExperts(E, H, cfg.moe_intermediate_size, method=moe_method, dtype=dtype,
                                    device=device, prefix=f"{prefix}.experts")
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = ReplicatedLinear(H, 1, bias=False, method=UnquantizedLinearMethod(),
                                                       dtype=dtype, device=device, prefix=f"{prefix}.shared_expert_gate")
        self.register_buffer("routing_buffer", None, persistent=False)  # set by enable_routing_buffer
        self.record_prefill = False
        self.last_routing: torch.Tensor | None = None

    def enable_routing_buffer(self, max_rows: int) -> None:
        """Allocate the static decode-routing buffer ``[max_rows, k]`` (once, before graph capture)."""
        if self.routing_buffer is None:
            self.routing_buffer = torch.full((max_rows, self.top_k), -1, dtype=ROUTING_DTYPE,
                                             device=self.gate.weight.device)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """x ``[B, S, H]`` -> ``[B, S, H]``."""
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        topk_ids, topk_weights = select_experts(self.gate(h), self.top_k, self.renormalize)
        if ctx is not None:
            if not ctx.is_prefill:
                if self.routing_buffer is not None and h.shape[0] <= self.routing_buffer.shape[0]:
                    self.routing_buffer[:h.shape[0]].copy_(topk_ids)
            elif self.record_prefill:
                self.last_routing = topk_ids
        out = self.experts(h, topk_ids, topk_weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return out.view(shape)
