"""What the engine reads from a Qwen2.5-VL / Qwen3-VL config: the language part (its
``text_config``, a Qwen2 / Qwen3 decoder with mRoPE) as a ``ModelConfig``, and ``VlDims``.

Qwen2.5-VL's language model is Qwen2 (q/k/v bias) with sectioned mRoPE; Qwen3-VL's is
Qwen3 (q/k RMSNorm) with interleaved mRoPE and deepstack (features of some vision layers
added to the first decoder layers' outputs at the image positions).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from hybridrl.data.vision import VisionTokens

VL_TEXT_FAMILY = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
"""VL model_type -> the decoder family its language model is."""


@dataclass(frozen=True)
class VlDims:
    """The vision side of a VL config."""

    family: str
    """"qwen2_5_vl" or "qwen3_vl"."""
    vision_config: Any
    """transformers' vision config (``hf_config.vision_config``): the tower is built from it."""
    tokens: VisionTokens
    """image token id, vision start/end ids, merge size."""
    deepstack_layers: int
    """decoder layers that get deepstack features added (Qwen3-VL; 0 for Qwen2.5-VL)."""


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def parse_vision_language(cfg: Any, parse_decoder: Callable[[Any, str], Any]):
    """A VL config -> the ``ModelConfig`` of its language part with ``vl`` set.
    ``parse_decoder(text_config, model_type)``: ``model_config.py``'s decoder parser."""
    family = _get(cfg, "model_type")
    text, vision = _get(cfg, "text_config"), _get(cfg, "vision_config")
    if text is None or vision is None or isinstance(text, dict) or isinstance(vision, dict):
        raise ValueError(f"{family}: the rollout engine needs the transformers config object with its "
                         "text_config and vision_config (AutoConfig.from_pretrained(path))")
    if _get(text, "use_sliding_window", False):
        raise ValueError(f"{family}: use_sliding_window=True is not supported by the rollout engine; set it to False")
    base = parse_decoder(text, VL_TEXT_FAMILY[family])
    rope = dict(base.rope)
    if "mrope_section" not in rope:
        raise ValueError(f"{family}: text_config.rope_parameters has no mrope_section; the engine needs it "
                         "for multimodal rotary positions")
    rope["mrope_interleaved"] = family == "qwen3_vl"  # transformers: Qwen3-VL always interleaves
    deepstack = len(_get(vision, "deepstack_visual_indexes", None) or ()) if family == "qwen3_vl" else 0
    if deepstack > base.num_layers:
        raise ValueError(f"{family}: {deepstack} deepstack_visual_indexes but only {base.num_layers} decoder layers")
    dims = VlDims(family=family, vision_config=vision, tokens=VisionTokens.from_hf_config(cfg),
                  deepstack_layers=deepstack)
    return dataclasses.replace(base, model_type=family, rope=rope,
                               tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)), vl=dims)
