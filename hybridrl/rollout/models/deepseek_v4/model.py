"""DeepSeek-V4 decoder (issue #32): full-sequence forward (prefill, logits) and decode.

transformers' ``DeepseekV4ForCausalLM`` module for module (names mirrored, so HF names route
by default): token embedding copied into ``hc_mult`` streams; per layer a hyper-connected
attention block (``models/deepseek_v4/attention.py``) and a hyper-connected MoE block; the streams
collapsed by the hyper head, normed, projected. The MoE block: a router that scores experts
with ``scoring_func`` (``sqrtsoftplus`` or ``sigmoid``) on logits in the model dtype, picks
them by the frozen ``tid2eid[token]`` table (``hash_moe`` layers) or by top-k of the scores
plus the correction bias (``moe`` layers), weights = the chosen scores renormalized times
``routed_scaling_factor``; experts and the one shared MLP use the clamped SwiGLU
(``swiglu_limit``). Every layer is MoE (V4 has no dense MLP layers).

Per-request attention state lives in ``rollout/models/deepseek_v4/state.py`` (``forward`` fills it at prefill,
``decode`` advances it); the top-k layers tap the routing record (``models/moe/block.py: RoutingTap``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.rollout.models.deepseek_v4.config import V4Dims
from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.layers.embedding import LMHead, VocabEmbedding
from hybridrl.rollout.layers.fused_moe import FusedExperts
from hybridrl.rollout.layers.moe_dispatch import swiglu
from hybridrl.rollout.models.deepseek_v4.hyper_connection import HyperConnection, HyperHead, expand
from hybridrl.rollout.layers.linear import MergedColumnLinear, RowParallelLinear
from hybridrl.rollout.layers.norm import RMSNorm, copy_loader
from hybridrl.rollout.models.deepseek_v4.attention import V4Attention, V4Rotary
from hybridrl.rollout.model_config import ModelConfig
from hybridrl.rollout.models.moe.block import RoutingTap

SCORE_FNS = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


class SharedMLP(nn.Module):
    """The shared expert: fused gate_up, clamped SwiGLU, down."""

    def __init__(self, hidden: int, width: int, limit: float, ctx: LayerContext):
        """Tensor parallel: a share of the width; ``down_proj``'s partial sum is left to the MoE block."""
        super().__init__()
        self.gate_up_proj = MergedColumnLinear(hidden, [width] * 2, ctx.child("gate_up_proj"))
        self.down_proj = RowParallelLinear(width, hidden, ctx.child("down_proj"), what="the shared expert width",
                                           reduce=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(swiglu(gate, up, self.limit))


class V4Router(nn.Module):
    """``mlp.gate``: ``weight [E, H]`` and either ``tid2eid [V, k]`` (int64, frozen: hash
    layers) or the float32 ``e_score_correction_bias [E]`` (top-k layers); all loaded by copy."""

    def __init__(self, cfg: ModelConfig, dims: V4Dims, hashed: bool, dtype, device):
        super().__init__()
        E, H, k = cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_tok
        self.top_k, self.hashed = k, hashed
        self.score = SCORE_FNS[dims.scoring_func]
        self.scaling = dims.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(E, H, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = copy_loader
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(cfg.vocab_size, k, dtype=torch.long, device=device),
                                        requires_grad=False)
            self.tid2eid.weight_loader = copy_loader
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32, device=device),
                                                        requires_grad=False)
            self.e_score_correction_bias.weight_loader = copy_loader

    def forward(self, h: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H], token_ids [T] -> (ids [T, k] int64, weights [T, k] in the scores' dtype)."""
        scores = self.score(F.linear(h, self.weight))
        if self.hashed:
            ids = self.tid2eid[token_ids]
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices
        w = scores.gather(1, ids)
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class V4MoE(RoutingTap, nn.Module):
    """Router + routed experts + the shared expert. A top-k layer is on the routing record's
    layer axis at ``moe_index`` (its position among the top-k layers); a hash layer is not
    (its choice is ``tid2eid[token]``, the same in the trainer by construction)."""

    def __init__(self, cfg: ModelConfig, dims: V4Dims, hashed: bool, moe_index: int, ctx: LayerContext):
        super().__init__()
        self.top_k, self.records_routing, self.tp = cfg.num_experts_per_tok, not hashed, ctx.tp
        self._init_routing_tap(moe_index)
        self.gate = V4Router(cfg, dims, hashed, ctx.dtype, ctx.device)  # whole on every rank: the same choices
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, ctx.child("experts"),
                                    swiglu_limit=dims.swiglu_limit)
        self.shared_experts = SharedMLP(cfg.hidden_size, cfg.moe_intermediate_size, dims.swiglu_limit,
                                        ctx.child("shared_experts"))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, decoding: bool = False) -> torch.Tensor:
        B, S, H = x.shape
        h = x.reshape(-1, H)
        ids, weights = self.gate(h, input_ids.reshape(-1))
        if self.records_routing:
            self.tap_routing(ids, decoding)
        out = self.experts(h, ids, weights.to(h.dtype)) + self.shared_experts(h)
        return self.tp.all_reduce_(out).view(B, S, H)  # the experts' and the shared expert's partial sums


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dims: V4Dims, idx: int, ctx: LayerContext):
        super().__init__()
        eps, H = cfg.rms_norm_eps, cfg.hidden_size
        self.self_attn = V4Attention(H, cfg.num_heads, dims, dims.layer_types[idx], eps, ctx.child("self_attn"))
        topk_layers = [i for i, t in enumerate(dims.mlp_layer_types) if t != "hash_moe"]
        hashed = idx not in topk_layers
        self.mlp = V4MoE(cfg, dims, hashed, -1 if hashed else topk_layers.index(idx), ctx.child("mlp"))
        self.input_layernorm = RMSNorm(H, eps, ctx.dtype, ctx.device)
        self.post_attention_layernorm = RMSNorm(H, eps, ctx.dtype, ctx.device)
        hc = dict(hc_mult=dims.hc_mult, hidden_size=H, sinkhorn_iters=dims.hc_sinkhorn_iters, hc_eps=dims.hc_eps,
                  norm_eps=eps, dtype=ctx.dtype, device=ctx.device)
        self.attn_hc, self.ffn_hc = HyperConnection(**hc), HyperConnection(**hc)

    def forward(self, streams, input_ids, attend, decoding: bool = False) -> torch.Tensor:
        """``attend(self_attn, x)``: the attention call (full-sequence or decode)."""
        post, comb, x = self.attn_hc(streams)
        streams = expand(post, comb, attend(self.self_attn, self.input_layernorm(x)), streams)
        post, comb, x = self.ffn_hc(streams)
        return expand(post, comb, self.mlp(self.post_attention_layernorm(x), input_ids, decoding), streams)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dims: V4Dims, max_seq_len: int, ctx: LayerContext):
        super().__init__()
        dtype, device = ctx.dtype, ctx.device
        self.dims = dims
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.child("embed_tokens"))
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, dims, i, ctx.child(f"layers.{i}"))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.hc_head = HyperHead(dims.hc_mult, cfg.hidden_size, dims.hc_eps, cfg.rms_norm_eps, dtype, device)
        self.rotary_emb = V4Rotary(dims, max_seq_len, dtype, device)

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor, state=None, row_start: int = 0) -> torch.Tensor:
        """input_ids [B, S], valid [B, S] bool (right padding) -> hidden [B, S, hidden]. With
        ``state`` (a ``V4StateCache``) its rows [row_start, row_start + B) are filled (prefill)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        lengths = valid.sum(dim=1)
        rows = slice(row_start, row_start + input_ids.shape[0])
        rot = self.rotary_emb
        streams = self._streams(input_ids)
        for i, layer in enumerate(self.layers):
            layer_state = state.layers[i] if state is not None else None
            streams = layer(streams, input_ids, lambda attn, x, s=layer_state: attn(x, positions, valid, rot, s, rows,
                                                                                     lengths))
        return self.norm(self.hc_head(streams))

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, state) -> torch.Tensor:
        """tokens, positions [B] of rows [0, B) of ``state`` -> hidden [B, hidden]."""
        ids = tokens.view(-1, 1)
        rot = self.rotary_emb
        # one table lookup per rope for the step, not one per layer (every layer reads the same)
        tabs = {label: rot.tables(label, positions.view(-1, 1)) for label in ("main", "compress")}
        streams = self._streams(ids)
        for i, layer in enumerate(self.layers):
            streams = layer(streams, ids, lambda attn, x, s=state.layers[i]: attn.decode(x, positions, rot, s, tabs),
                            decoding=True)
        return self.norm(self.hc_head(streams))[:, 0]

    def _streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x.unsqueeze(2).expand(-1, -1, self.dims.hc_mult, -1).contiguous()


class DeepseekV4ForCausalLM(nn.Module):
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    routing_recorder = None  # set by hybridrl.rollout.routing.enable_routing_record

    def __init__(self, cfg: ModelConfig, dims: V4Dims, max_seq_len: int, ctx: LayerContext):
        """``ctx``: the model's root ``LayerContext`` (``layers/context.py``)."""
        super().__init__()
        self.config, self.dims, self.tp = cfg, dims, ctx.tp
        self.model = DeepseekV4Model(cfg, dims, max_seq_len, ctx.child("model"))
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ctx.child("lm_head"), tied_to=tied)

    def logits(self, input_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[B, S] right-padded -> logits [B, S, V] float32."""
        return self.lm_head(self.model(input_ids, valid)).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
