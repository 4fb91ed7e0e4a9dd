"""Llama / Qwen2 / Qwen3 (and Qwen3-MoE / Qwen2-MoE) and DeepSeek-V3 decoder in the
inference layout (fused qkv_proj, gate_up_proj; MoE layers: ``models/moe/block.py``; DeepSeek's
multi-head latent attention: ``models/deepseek_v3/mla.py``, its first ``first_k_dense_replace``
layers dense, the rest DeepSeekMoE).

Composition only: the layers own their weights and loaders; every module is built with its
``LayerContext`` (``layers/context.py``: the quantization methods, dtype, device, its module
name), whose ``tp`` splits every layer Megatron-style (``layers/tensor_parallel.py``). Module
names mirror the Hugging Face ones so that an HF name maps to ours by `packed_modules_mapping` alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.exact.ops import pieced_unary
from hybridrl.rollout.layers.attention import Attention, ForwardContext
from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.layers.embedding import LMHead, VocabEmbedding
from hybridrl.rollout.layers.linear import MergedColumnLinear, RowParallelLinear
from hybridrl.rollout.models.deepseek_v3.mla import MlaAttention, MlaRotary
from hybridrl.rollout.layers.norm import RMSNorm
from hybridrl.rollout.layers.rotary import rotary_for
from hybridrl.rollout.model_config import ModelConfig
from hybridrl.rollout.models.moe.block import SparseMoeBlock


class MLP(nn.Module):
    """Gated MLP; under ``ctx.tp`` column-parallel gate/up, row-parallel down (``reduce=False``:
    its partial sum is left to the caller, the MoE block's one all-reduce)."""

    def __init__(self, cfg: ModelConfig, ctx: LayerContext, intermediate_size: int | None = None,
                 reduce: bool = True):
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnLinear(cfg.hidden_size, [width] * 2, ctx.child("gate_up_proj"),
                                               bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(width, cfg.hidden_size, ctx.child("down_proj"), bias=cfg.mlp_bias,
                                           what="the MLP intermediate size", reduce=reduce)
        self.exact = ctx.exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = pieced_unary(F.silu, gate) if self.exact else F.silu(gate)  # exact: every element on the SIMD path
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, ctx: LayerContext, rotary: nn.Module | None = None):
        """``rotary``: the model's MLA rope tables (shared by every MLA layer)."""
        super().__init__()
        if cfg.mla is not None:
            self.self_attn = MlaAttention(cfg, idx, ctx.child("self_attn"), rotary)
        else:
            self.self_attn = Attention(cfg, idx, ctx.child("self_attn"))
        self.is_moe = cfg.is_moe_layer(idx)
        if self.is_moe:
            shared_name = "shared_experts" if cfg.router is not None else "shared_expert"
            shared = (MLP(cfg, ctx.child(f"mlp.{shared_name}"), cfg.shared_expert_intermediate_size, reduce=False)
                      if cfg.shared_expert_intermediate_size else None)
            self.mlp = SparseMoeBlock(cfg, cfg.moe_layers.index(idx), ctx.child("mlp"), shared_expert=shared)
        else:
            self.mlp = MLP(cfg, ctx.child("mlp"))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype, ctx.device, ctx.exact)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype, ctx.device, ctx.exact)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext):
        """Returns (mlp output, residual stream before it); the next layer adds them."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, ctx)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return (self.mlp(h, ctx) if self.is_moe else self.mlp(h)), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_seq_len: int, ctx: LayerContext):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.child("embed_tokens"))
        rotary = (MlaRotary(cfg, max_seq_len, ctx.dtype, ctx.device, ctx.exact) if cfg.mla is not None
                  else rotary_for(cfg.rope, cfg.head_dim, max_seq_len, ctx.dtype, ctx.device, ctx.exact))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ctx.child(f"layers.{i}"), rotary)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype, ctx.device, ctx.exact)
        self.rotary_emb = rotary

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [B, S] -> final hidden states [B, S, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        x, _ = self.norm.add_forward(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    """The causal LM. ``packed_modules_mapping``: HF q/k/v and gate/up module names ->
    (fused module, shard id); ``hybridrl.rollout.weight_routes`` builds every route from it
    (fused experts route their own weights, ``layers/fused_moe.py``).

    ``ctx``: the model's root ``LayerContext`` (``layers/context.py``; built by ``rollout/engine.py:
    build_model``), which every module below hands its children.
    """

    routing_recorder = None  # set by hybridrl.rollout.routing.enable_routing_record

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_seq_len: int, ctx: LayerContext):
        super().__init__()
        self.config, self.tp, self.exact = cfg, ctx.tp, ctx.exact
        self.model = DecoderModel(cfg, max_seq_len, ctx.child("model"))
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ctx.child("lm_head"), tied_to=tied)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., V] in the model dtype."""
        return self.lm_head(hidden)
