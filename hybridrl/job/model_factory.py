"""Build the trainer's model and tokenizer: a built-in tiny model (``model.arch``: Qwen2,
DeepSeek-V3, DeepSeek-V4, Qwen2.5-VL or Qwen3-VL); a local checkpoint loads through
``trainer/pretrained.py``."""

from __future__ import annotations

import torch

from hybridrl.config import ModelConfig
from hybridrl.config.model import VL_ARCHS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def builtin_tokenizer(arch: str = "qwen2"):
    """The arithmetic character tokenizer; for a vision-language ``arch`` the chat tokenizer
    with the vision markers (``data/vl_tokenizer.py``)."""
    if arch in VL_ARCHS:
        from hybridrl.data.vl_tokenizer import build_vl_chat_tokenizer

        return build_vl_chat_tokenizer()
    from hybridrl.data.char_tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def builtin_model(tokenizer, spec: ModelConfig, *, seed: int = 0, max_position_embeddings: int = 128):
    """A random-init causal LM of family ``spec.arch`` sized by ``spec`` (``model.*``: sizes,
    tying, dtype) for the arithmetic task; initialized in float32 from ``seed``, then cast to
    ``spec.dtype``."""
    from transformers import DeepseekV3ForCausalLM, DeepseekV4ForCausalLM, Qwen2ForCausalLM

    if spec.arch in VL_ARCHS:
        return builtin_vl_model(tokenizer, spec, seed=seed, max_position_embeddings=max_position_embeddings)
    make_config, cls = {"qwen2": (qwen2_config, Qwen2ForCausalLM),
                        "deepseek_v3": (deepseek_v3_config, DeepseekV3ForCausalLM),
                        "deepseek_v4": (deepseek_v4_config, DeepseekV4ForCausalLM)}[spec.arch]
    config = make_config(tokenizer, spec, max_position_embeddings)
    torch.manual_seed(seed)
    model = cast_as_loaded(cls(config), DTYPES[spec.dtype])
    if spec.arch == "deepseek_v4":
        _init_v4_tables(model, seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def qwen2_config(tokenizer, spec: ModelConfig, max_position_embeddings: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )


def deepseek_v3_config(tokenizer, spec: ModelConfig, max_position_embeddings: int):
    """The built-in DeepSeek-V3-family model: DeepSeek-V3's shape at toy width.

    MLA with per-head ``qk_nope = v = hidden / heads``, a ``qk_rope`` of half that and a
    latent of ``hidden / 2`` (no q-LoRA at this width); layer 0 dense (``first_k_dense_replace``),
    the others DeepSeekMoE: 8 routed experts of ``intermediate / 4`` in 4 groups, the best 2
    groups kept, top-2, one shared expert, renormalized. ``routed_scaling_factor`` 1.0, not
    DeepSeek-V3's 2.5 (tuned for top-8 of 256 experts): on the default job 2.5 measured 0.879
    held-out after 300 RL steps, 1.0 measured 0.910 (seed 0).
    ``model.num_key_value_heads`` does not apply (MLA: every head reads the latent).
    """
    from transformers import DeepseekV3Config

    head = spec.hidden_size // spec.num_attention_heads
    return DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_attention_heads,
        intermediate_size=spec.intermediate_size, moe_intermediate_size=max(spec.intermediate_size // 4, 1),
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=min(1, spec.num_hidden_layers - 1), norm_topk_prob=True, routed_scaling_factor=1.0,
        q_lora_rank=None, kv_lora_rank=max(spec.hidden_size // 2, 2), qk_nope_head_dim=head,
        qk_rope_head_dim=max(2 * (head // 4), 2), v_head_dim=head, rope_interleave=True, num_mtp_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def deepseek_v4_config(tokenizer, spec: ModelConfig, max_position_embeddings: int):
    """The built-in DeepSeek-V4-family model, sized so that the default task's ~15-token
    sequences exercise every layer type: sliding window 4, CSA every 2 tokens (the indexer
    keeps the best 2 entries), HCA every 4; layers cycle sliding / CSA / HCA (3 layers at
    least), the first hash-routed; per head 2 * hidden / heads wide with a quarter of it
    rotary; 8 experts of ``intermediate / 4``, top-2; 2 hyper-connection streams.
    ``model.num_key_value_heads`` does not apply (one shared K=V head)."""
    from transformers import DeepseekV4Config

    layers = max(spec.num_hidden_layers, 3)
    head = 2 * spec.hidden_size // spec.num_attention_heads
    types = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    return DeepseekV4Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=1, head_dim=head,
        partial_rotary_factor=0.25, q_lora_rank=spec.hidden_size // 2, o_groups=2, o_lora_rank=spec.hidden_size // 4,
        moe_intermediate_size=max(spec.intermediate_size // 4, 32), n_routed_experts=8, num_experts_per_tok=2,
        hc_mult=2, hc_sinkhorn_iters=20, sliding_window=4,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        layer_types=[types[i % 3] for i in range(layers)], mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1),
        index_n_heads=16, index_head_dim=max(head // 4, 16), index_topk=2, routed_scaling_factor=1.0,
        num_nextn_predict_layers=0, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )


def _init_v4_tables(model, seed: int) -> None:
    """transformers initialises the hash router's token -> expert table to zeros (a released
    checkpoint ships it): give every token k distinct experts, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                E = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:b.shape[1]] for _ in range(b.shape[0])]))


# The built-in vision towers: Qwen2.5-VL's (patch 14, RMSNorm, SwiGLU, windowed attention
# in the first block, full attention in the last) and Qwen3-VL's (patch 16, learned position
# embeddings interpolated to the grid, a deepstack merger after block 0), both merging 2x2
# patches into one language-model token, at toy width.
VISION_HIDDEN, VISION_HEADS, VISION_DEPTH = 64, 2, 2


def builtin_vl_model(tokenizer, spec: ModelConfig, *, seed: int = 0, max_position_embeddings: int = 128):
    """A random-init Qwen2.5-VL / Qwen3-VL (``spec.arch``) whose language model is sized by
    ``spec`` and whose vision tower is ``VISION_*``; the tokenizer must have the vision markers
    (``builtin_tokenizer(arch)``). Initialized in float32 from ``seed``, then cast."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    config = qwen2_5_vl_config(tokenizer, spec, max_position_embeddings) if spec.arch == "qwen2_5_vl" else \
        qwen3_vl_config(tokenizer, spec, max_position_embeddings)
    cls = Qwen2_5_VLForConditionalGeneration if spec.arch == "qwen2_5_vl" else Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cast_as_loaded(cls(config), DTYPES[spec.dtype])
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def cast_as_loaded(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` keeping the rotary ``inv_freq`` buffers in float32, as
    ``from_pretrained(dtype=...)`` leaves them (a plain ``.to(bfloat16)`` rounds the
    frequencies to 8 bits: every position's angle then differs from the checkpoint-loaded
    model's and the engines' float32 tables, and exact mode could not match both)."""
    keep = {name: buf for name, buf in model.named_buffers() if name.endswith("inv_freq")}
    model.to(dtype)
    for name, buf in keep.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner).register_buffer(attr, buf, persistent=False)
    return model


def _mrope_section(head_dim: int, hw_share: tuple[int, int]) -> list[int]:
    """(t, h, w) rotary frequency pairs of a head: h = w = half * share (Qwen2.5-VL 3/8 of 64
    pairs = 24, Qwen3-VL 5/16 = 20), t the rest."""
    half = head_dim // 2
    hw = max(half * hw_share[0] // hw_share[1], 1)
    return [half - 2 * hw, hw, hw]


def _text_kwargs(tokenizer, spec: ModelConfig, max_position_embeddings: int) -> tuple[dict, dict]:
    """The language model's config kwargs sized by ``spec``, and the vision token ids."""
    from hybridrl.data.vl_tokenizer import vision_token_ids

    return dict(vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
                num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
                intermediate_size=spec.intermediate_size, max_position_embeddings=max_position_embeddings,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id), vision_token_ids(tokenizer)


def qwen2_5_vl_config(tokenizer, spec: ModelConfig, max_position_embeddings: int):
    from transformers import Qwen2_5_VLConfig

    text, marks = _text_kwargs(tokenizer, spec, max_position_embeddings)
    head = spec.hidden_size // spec.num_attention_heads
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope_section(head, (3, 8))}
    vision = dict(depth=VISION_DEPTH, hidden_size=VISION_HIDDEN, intermediate_size=2 * VISION_HIDDEN,
                  num_heads=VISION_HEADS, out_hidden_size=spec.hidden_size, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, fullatt_block_indexes=[VISION_DEPTH - 1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=spec.tie_word_embeddings,
                            **marks)


def qwen3_vl_config(tokenizer, spec: ModelConfig, max_position_embeddings: int):
    from transformers import Qwen3VLConfig

    text, marks = _text_kwargs(tokenizer, spec, max_position_embeddings)
    head = spec.hidden_size // spec.num_attention_heads
    text.update(head_dim=head, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": _mrope_section(head, (5, 16)), "mrope_interleaved": True})
    vision = dict(depth=VISION_DEPTH, hidden_size=VISION_HIDDEN, intermediate_size=2 * VISION_HIDDEN,
                  num_heads=VISION_HEADS, out_hidden_size=spec.hidden_size, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0])
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=spec.tie_word_embeddings,
                         **marks)
