"""MoE load-balancing losses over the router logits the trainer's forward collected
(``MoEForward.router_logits``): transformers' Switch loss, DeepSeek-V3's complementary
loss, DeepSeek-V4's own."""

from __future__ import annotations

import torch


def router_load_balancing_loss(model: torch.nn.Module, router_logits: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The MoE load-balancing loss (Switch Transformer, Fedus et al. 2021; transformers'
    ``load_balancing_loss_func``) over every real token of the backbone calls whose router
    logits were collected (one tuple per call, one ``[T, E]`` per MoE layer)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    config = model.config
    per_layer = tuple(torch.cat(layer) for layer in zip(*router_logits))
    if config.model_type == "deepseek_v3":
        return sigmoid_balance_loss(model, per_layer)
    if config.model_type == "deepseek_v4":  # transformers' own V4 loss, over its top-k router layers
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import load_balancing_loss_func as v4_loss

        return v4_loss(per_layer, config.n_routed_experts, config.num_experts_per_tok)
    return load_balancing_loss_func(per_layer, config.num_experts, config.num_experts_per_tok)


def sigmoid_balance_loss(model: torch.nn.Module, per_layer: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """DeepSeek-V3's complementary balance loss (its report, eq. 17-20), over the batch's
    tokens rather than per sequence: per MoE layer ``E * sum_i f_i P_i`` with ``f_i`` the
    fraction of the ``T * k`` token slots routed to expert i (the router's own grouped, bias-corrected
    selection) and ``P_i`` the mean of the sum-normalized sigmoid scores; averaged over
    layers. 1.0 when the load is uniform."""
    from hybridrl.rollout.models.moe.block import select_experts_grouped
    from hybridrl.rollout.routing import hf_routers

    total = 0.0
    for router, logits in zip(hf_routers(model), per_layer):
        logits = logits.float()
        scores = logits.sigmoid()
        with torch.no_grad():
            ids, _ = select_experts_grouped(logits, router.e_score_correction_bias, router.top_k,
                                            router.num_group, router.topk_group, router.norm_topk_prob, 1.0)
            E = scores.shape[-1]
            f = torch.bincount(ids.reshape(-1), minlength=E).float() / ids.numel()
        p = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)
        total = total + E * (f * p).sum()
    return total / len(per_layer)
