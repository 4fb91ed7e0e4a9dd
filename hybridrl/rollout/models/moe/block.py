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

DeepSeek-V3 (``cfg.router`` set): ``mlp.gate`` is a :class:`GroupedTopkRouter` (``weight
[E, H]`` and the float32 ``e_score_correction_bias [E]``, both unquantized), the shared
experts ``mlp.shared_experts.{gate,up,down}_proj`` are ungated, and the selection is
:func:`select_experts_grouped` (transformers' ``DeepseekV3TopkRouter``).

Qwen routing is transformers' exactly: ``softmax(router_logits, float32)``, ``topk`` (sorted),
renormalized when ``norm_topk_prob``, weights cast to the hidden dtype; an expert's output
is ``down(silu(gate(x)) * up(x))`` times its weight, summed over the k experts.

Tensor parallel: the router is whole on every rank (every rank routes every token the same
way), the experts and shared experts hold a share of their width (``layers/fused_moe.py``)
and the block sums their partial outputs with one all-reduce.

Exact numerics (``LayerContext.exact``, ``rollout.exact``): the block computes what
transformers 5.19's ``Qwen2MoeSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock`` / ``DeepseekV3MoE``
compute under ``hybridrl.exact.batch_invariant()`` with the eager experts (what
``exact_attention_for`` switches them to), op for op: the router GEMM row-tiled, the Qwen
softmax as ``exact_softmax`` and DeepSeek's sigmoid SIMD-pieced (:func:`select_experts_exact`,
:func:`select_experts_grouped_exact`: the latter's final top-k unsorted, its weights left
float32, as transformers'), the experts as its per-expert loop (``exact_experts``), the
shared expert gate's sigmoid pieced. The record below keeps working (the same ids).

Routing record (``hybridrl/rollout/routing.py``): :class:`RoutingTap`, the block's side of it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.exact.ops import exact_softmax, padded_linear, pieced_unary
from hybridrl.rollout.layers.attention import ForwardContext
from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.layers.fused_moe import FusedExperts
from hybridrl.rollout.layers.linear import ReplicatedLinear
from hybridrl.rollout.layers.norm import copy_loader
from hybridrl.rollout.model_config import ModelConfig

ROUTING_DTYPE = torch.int16  # expert ids as recorded (E <= 32767)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits ``[T, E]`` -> (topk_ids ``[T, k]`` int64, topk_weights ``[T, k]`` in the logits dtype)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(router_logits.dtype)


def select_experts_grouped(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                           topk_group: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router on float32 ``router_logits [T, E]`` -> (ids ``[T, k]`` int64,
    weights ``[T, k]`` float32).

    ``scores = sigmoid(logits)``; the *selection* adds ``bias`` (the load-balancing correction):
    a group's score is the sum of its best two biased scores, the ``topk_group`` best groups
    stay, and the top-k biased scores among their experts are chosen. The *weights* are the
    unbiased scores of the chosen experts, renormalized (``+ 1e-20``) when ``renormalize``,
    times ``scaling`` (``routed_scaling_factor``). Ids in descending biased score.
    """
    T, E = router_logits.shape
    scores = router_logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # (T, G)
    groups = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k=top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def select_experts_exact(router_logits: torch.Tensor, top_k: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_experts` as ``Qwen3MoeTopKRouter`` computes it under ``batch_invariant()``:
    ``F.softmax(logits, dtype=float)`` is the cast then ``exact_softmax`` (fixed-order sum,
    SIMD-path exp); router_logits ``[T, E]`` -> (ids ``[T, k]`` int64, weights ``[T, k]`` in the logits dtype)."""
    probs = exact_softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(router_logits.dtype)


def select_experts_grouped_exact(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                                 topk_group: int, renormalize: bool,
                                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_experts_grouped` as ``DeepseekV3TopkRouter`` computes it under
    ``batch_invariant()``: the sigmoid SIMD-pieced and the final top-k **unsorted** (its order
    is the order the k weights are summed in when renormalized, so it sets their bits).
    float32 ``router_logits [T, E]`` -> (ids ``[T, k]`` int64, weights ``[T, k]`` float32)."""
    T, E = router_logits.shape
    scores = pieced_unary(torch.sigmoid, router_logits)
    choice = scores + bias
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # (T, G)
    groups = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


class GroupedTopkRouter(nn.Module):
    """DeepSeek-V3's ``mlp.gate``: ``weight [E, H]`` (engine dtype) and
    ``e_score_correction_bias [E]`` (float32, as transformers keeps it), plain parameters
    loaded by copy. The logits are computed in float32 like transformers'."""

    def __init__(self, num_experts: int, hidden_size: int, dtype, device, exact: bool = False):
        super().__init__()
        self.exact = exact
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device),
                                                    requires_grad=False)
        self.weight.weight_loader = self.e_score_correction_bias.weight_loader = copy_loader

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] -> router logits [T, E] float32."""
        if self.exact:  # transformers' F.linear under batch_invariant(): row-tiled
            return padded_linear(h.float(), self.weight.float())
        return F.linear(h.float(), self.weight.float())


class RoutingTap:
    """What the routing record (``hybridrl/rollout/routing.py``) reads from an MoE block: the
    decode step's top-k ids copied into a static ``routing_buffer [max_rows, k]`` (a captured
    graph writes it on every replay) and, during a recorded prefill, a reference to the
    prefill's ids (``last_routing``). ``moe_index``: the block's position on the record's layer
    axis; ``records_routing``: False for a block whose choice needs no record (DeepSeek-V4's
    hash layers: ``tid2eid[token]``)."""

    moe_index: int
    top_k: int
    records_routing: bool = True

    def _init_routing_tap(self, moe_index: int) -> None:
        self.moe_index = moe_index
        self.register_buffer("routing_buffer", None, persistent=False)  # set by enable_routing_buffer
        self.record_prefill = False
        self.last_routing: torch.Tensor | None = None

    def enable_routing_buffer(self, max_rows: int) -> None:
        """Allocate the static decode-routing buffer ``[max_rows, k]`` (once, before graph capture)."""
        if self.routing_buffer is None:
            self.routing_buffer = torch.full((max_rows, self.top_k), -1, dtype=ROUTING_DTYPE,
                                             device=self.gate.weight.device)

    def tap_routing(self, topk_ids: torch.Tensor, decoding: bool) -> None:
        """``topk_ids [T, k]`` of this forward: a decode step's into the buffer, a recorded prefill's kept."""
        if decoding:
            if self.routing_buffer is not None and topk_ids.shape[0] <= self.routing_buffer.shape[0]:
                self.routing_buffer[:topk_ids.shape[0]].copy_(topk_ids)
        elif self.record_prefill:
            self.last_routing = topk_ids


class SparseMoeBlock(RoutingTap, nn.Module):
    def __init__(self, cfg: ModelConfig, moe_index: int, ctx: LayerContext, shared_expert: nn.Module | None = None):
        """``shared_expert``: built with ``ctx.tp`` and ``reduce=False`` (this block reduces it)."""
        super().__init__()
        self.tp = ctx.tp
        H, E = cfg.hidden_size, cfg.num_experts
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self._init_routing_tap(moe_index)  # position among the model's MoE layers (the record's layer axis)
        self.grouped, self.exact = cfg.router, ctx.exact
        if self.grouped is not None:
            self.gate = GroupedTopkRouter(E, H, ctx.dtype, ctx.device, ctx.exact)
        else:
            self.gate = ReplicatedLinear(H, E, ctx.child("gate").unquantized())
        self.experts = FusedExperts(E, H, cfg.moe_intermediate_size, ctx.child("experts"))
        self.shared_expert = self.shared_experts = None
        if self.grouped is not None:  # DeepSeek: ``mlp.shared_experts``, ungated
            self.shared_experts = shared_expert
        elif shared_expert is not None:  # Qwen2-MoE: ``mlp.shared_expert``, gated
            self.shared_expert = shared_expert
            self.shared_expert_gate = ReplicatedLinear(H, 1, ctx.child("shared_expert_gate").unquantized())

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """x ``[B, S, H]`` -> ``[B, S, H]``."""
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        topk_ids, topk_weights = self.select(h)
        if ctx is not None:
            self.tap_routing(topk_ids, decoding=not ctx.is_prefill)
        out = self.experts(h, topk_ids, topk_weights)
        if self.shared_expert is not None:
            gate = self.shared_expert_gate(h)
            gate = pieced_unary(torch.sigmoid, gate) if self.exact else torch.sigmoid(gate)
            out = out + gate * self.shared_expert(h)
        elif self.shared_experts is not None:
            out = out + self.shared_experts(h)
        return self.tp.all_reduce_(out).view(shape)  # the experts' and shared experts' partial sums

    def select(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] in h's dtype; exact DeepSeek:
        float32, as transformers' router returns them and its experts multiply by them)."""
        if self.grouped is None:
            pick = select_experts_exact if self.exact else select_experts
            return pick(self.gate(h), self.top_k, self.renormalize)
        g = self.grouped
        pick = select_experts_grouped_exact if self.exact else select_experts_grouped
        ids, weights = pick(self.gate(h), self.gate.e_score_correction_bias, self.top_k,
                            g.n_group, g.topk_group, self.renormalize, g.routed_scaling_factor)
        return ids, weights if self.exact else weights.to(h.dtype)
