"""Llama / Qwen2 / Qwen3 (and Qwen3-MoE / Qwen2-MoE) and DeepSeek-V3 decoder in the
inference layout (fused qkv_proj, gate_up_proj; MoE layers: ``models/moe/block.py``; DeepSeek's
multi-head latent attention: ``models/deepseek_v3/mla.py``, its first ``first_k_dense_replace``
layers dense, the rest DeepSeekMoE).

Composition only: the layers own their weights and loaders. ``tp`` (a
``TensorParallel``) splits every layer Megatron-style (``layers/tensor_parallel.py``). Module names mirror the
Hugging Face ones so that an HF name maps to ours by `packed_modules_mapping` alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.rollout.layers.attention import Attention, ForwardContext
from hybridrl.rollout.layers.embedding import LMHead, VocabEmbedding
from hybridrl.rollout.layers.fused_moe_method import FusedMoEMethodBase, UnquantizedFusedMoEMethod
from hybridrl.rollout.layers.linear import MergedColumnLinear, RowParallelLinear
from hybridrl.rollout.layers.linear_method import LinearMethodBase
from hybridrl.rollout.models.deepseek_v3.mla import MlaAttention, MlaRotary
from hybridrl.rollout.layers.norm import RMSNorm
from hybridrl.rollout.layers.rotary import RotaryEmbedding
from hybridrl.rollout.layers.tensor_parallel import SINGLE, TensorParallel
from hybridrl.rollout.model_config import ModelConfig
from hybridrl.rollout.models.moe.block import SparseMoeBlock


class MLP(nn.Module):
    """Gated MLP; under ``tp`` column-parallel gate/up, row-parallel down (``reduce=False``:
    its partial sum is left to the caller, the MoE block's one all-reduce)."""

    def __init__(self, cfg: ModelConfig, method: LinearMethodBase, dtype, device, prefix: str,
                 intermediate_size: int | None = None, tp: TensorParallel = SINGLE, reduce: bool = True):
        super().__init__()
        kw = dict(bias=cfg.mlp_bias, method=method, dtype=dtype, device=device)
        width = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnLinear(cfg.hidden_size, [width] * 2, tp=tp,
                                               prefix=f"{prefix}.gate_up_proj", **kw)
        self.down_proj = RowParallelLinear(width, cfg.hidden_size, tp=tp, what="the MLP intermediate size",
                                           reduce=reduce, prefix=f"{prefix}.down_proj", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, method: LinearMethodBase, dtype, device, prefix: str,
                 moe_method: FusedMoEMethodBase | None = None, rotary: nn.Module | None = None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        if cfg.mla is not None:
            self.self_attn = MlaAttention(cfg, idx, method, dtype, device, f"{prefix}.self_attn", rotary, tp=tp)
        else:
            self.self_attn = Attention(cfg, idx, method, dtype, device, f"{prefix}.self_attn", tp=tp)
        self.is_moe = cfg.is_moe_layer(idx)
        if self.is_moe:
            shared_name = "shared_experts" if cfg.router is not None else "shared_expert"
            shared = (MLP(cfg, method, dtype, device, f"{prefix}.mlp.{shared_name}", cfg.shared_expert_intermediate_size,
                          tp=tp, reduce=False) if cfg.shared_expert_intermediate_size else None)
            self.mlp = SparseMoeBlock(cfg, cfg.moe_layers.index(idx), moe_method or UnquantizedFusedMoEMethod(),
                                      dtype, device, f"{prefix}.mlp", shared_expert=shared, tp=tp)
        else:
            self.mlp = MLP(cfg, method, dtype, device, f"{prefix}.mlp", tp=tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

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
    def __init__(self, cfg: ModelConfig, method: LinearMethodBase, max_seq_len: int, dtype, device,
                 moe_method: FusedMoEMethodBase | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device, tp=tp)
        rotary = (MlaRotary(cfg, max_seq_len, dtype, device) if cfg.mla is not None
                  else RotaryEmbedding(cfg.rope, cfg.head_dim, max_seq_len, dtype, device))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, method, dtype, device, f"model.layers.{i}", moe_method, rotary, tp=tp)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
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

    ``moe_method``: how MoE experts are stored; default: what the linear method carries as
    ``method.moe_method`` (set by ``layers.quantization.get_linear_method``), else unquantized.
    """

    routing_recorder = None  # set by hybridrl.rollout.routing.enable_routing_record

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, method: LinearMethodBase, max_seq_len: int, dtype, device,
                 moe_method: FusedMoEMethodBase | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config, self.tp = cfg, tp
        moe_method = moe_method or getattr(method, "moe_method", None)
        self.model = DecoderModel(cfg, method, max_seq_len, dtype, device, moe_method, tp=tp)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, device, tied_to=tied, tp=tp)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., V] in the model dtype."""
        return self.lm_head(hidden)
