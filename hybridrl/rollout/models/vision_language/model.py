"""Qwen2.5-VL / Qwen3-VL for the engine: transformers' vision tower (``model.visual``) in
front of our decoder (``model.language_model``), module names as transformers 5's
``Qwen2_5_VLForConditionalGeneration`` / ``Qwen3VLForConditionalGeneration`` name their
parameters, so every HF name routes by ``packed_modules_mapping`` or by its own name.

Composition only. Packing applies to the language model alone: the route table fuses only
our ``LinearBase`` layers, and the tower's modules (Qwen2.5-VL's vision MLP has its own
``gate_proj`` / ``up_proj``) are plain transformers modules, each routed by its own name.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridrl.data.vision import ImageInputs
from hybridrl.rollout.layers.attention import ForwardContext
from hybridrl.rollout.layers.context import LayerContext
from hybridrl.rollout.layers.embedding import LMHead
from hybridrl.rollout.model_config import ModelConfig
from hybridrl.rollout.models.decoder.model import DecoderForCausalLM, DecoderModel
from hybridrl.rollout.models.vision_language.vision_tower import (ImageFeatures, VisionCounter, build_vision_tower,
                                                                  encode_images)


class VisionLanguageTextModel(DecoderModel):
    """The decoder, with image features written over the image tokens' embeddings and
    (Qwen3-VL) deepstack features added after the first decoder layers (``ctx.visual``)."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int, ctx: LayerContext):
        super().__init__(cfg, max_seq_len, ctx)
        self.exact = ctx.exact

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [B, S] -> final hidden states [B, S, hidden]."""
        visual = ctx.visual
        x, residual = self.embed_tokens(input_ids), None
        H = x.shape[-1]
        if visual is not None:
            x.view(-1, H)[visual.index] = visual.features.to(x.dtype)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, ctx)
            if visual is not None and i < len(visual.deepstack):
                # transformers adds them to the layer's output hidden states (Qwen3VLTextModel.
                # _deepstack_process); ours is split as (x, residual) and summed by the next
                # layer (or the final norm), so adding to x adds to that sum
                if self.exact:  # ... in transformers' order: (x + residual) + deepstack, then
                    # carried as the residual beside a -0.0 x (x + -0.0 == x bit for bit, zeros' signs too)
                    residual = x + residual
                    residual.view(-1, H)[visual.index] += visual.deepstack[i].to(x.dtype)
                    x = torch.full_like(x, -0.0)
                else:
                    x.view(-1, H)[visual.index] += visual.deepstack[i].to(x.dtype)
        x, _ = self.norm.add_forward(x, residual)
        return x


class VisionLanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_seq_len: int, ctx: LayerContext):
        super().__init__()
        self.visual = build_vision_tower(cfg.vl, ctx.dtype, ctx.device)
        self.language_model = VisionLanguageTextModel(cfg, max_seq_len, ctx.child("language_model"))
        self.vision_counter = VisionCounter()
        self.exact = ctx.exact  # the tower under hybridrl.exact, as the trainer runs it (rollout.exact)

    @property
    def rotary_emb(self) -> nn.Module:
        return self.language_model.rotary_emb

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.language_model(input_ids, ctx)

    def encode(self, images: ImageInputs) -> ImageFeatures:
        """One vision-tower call over ``images``, features in the language model's dtype."""
        if not self.exact:
            return encode_images(self.visual, images, self.vision_counter)
        from hybridrl.exact import batch_invariant

        # exact: transformers' tower under the trainer's numerics; the engine's step runs with
        # torch functions disabled (its own layers call their exact kernels), so re-enable them here
        with torch._C._EnableTorchFunction(), batch_invariant():
            return encode_images(self.visual, images, self.vision_counter)


class VisionLanguageForCausalLM(nn.Module):
    """The VL causal LM: ``DecoderForCausalLM``'s fused-name mapping and head over
    ``VisionLanguageModel`` (``hybridrl.rollout.weight_routes`` builds every route from it)."""

    routing_recorder = None  # the routing recorder is for MoE layers; these are dense
    packed_modules_mapping = DecoderForCausalLM.packed_modules_mapping

    def __init__(self, cfg: ModelConfig, max_seq_len: int, ctx: LayerContext):
        super().__init__()
        self.config, self.tp, self.exact = cfg, ctx.tp, ctx.exact
        self.model = VisionLanguageModel(cfg, max_seq_len, ctx.child("model"))
        tied = self.model.language_model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ctx.child("lm_head"), tied_to=tied)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., V] in the model dtype."""
        return self.lm_head(hidden)
