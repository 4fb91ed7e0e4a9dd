"""The built-in vision-language tokenizer: the built-in chat tokenizer (``chat_tokenizer.py``)
plus Qwen's vision markers as single tokens, and a chat template whose message content may
mix ``{"type": "image"}`` and ``{"type": "text", "text": ...}`` items.

An image item renders as ``<|vision_start|><|image_pad|><|vision_end|>`` (Qwen2-VL's chat
templates do the same); ``vl_prompts.py`` then expands each ``<|image_pad|>`` to the image's
feature count, as transformers' Qwen processors do. The text-only tokenizers keep their ids:
the vision markers exist only in this one.
"""

from __future__ import annotations

from hybridrl.data.chat_tokenizer import CHAT_CHARS, CHAT_SPECIALS

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
VISION_SPECIALS = (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)
IMAGE_ITEM = VISION_START + IMAGE_PAD + VISION_END

# CHAT_TEMPLATE's layout, content either a string or a list of image / text items
VL_CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|system|>tools: ' }}"
    "{%- for t in tools %}{{ t.function.name + '(' + (t.function.parameters.properties | list | join(',')) + ')' }}"
    "{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}{{ '<|end|>' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|' + m.role + '|>' }}"
    "{%- if m.content is string %}{{ m.content }}{%- else %}{%- for item in m.content %}"
    "{%- if item.type == 'image' or 'image' in item %}{{ '" + IMAGE_ITEM + "' }}"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{ '<|end|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{%- endif %}"
)


def build_vl_chat_tokenizer():
    """The chat character tokenizer with ``CHAT_SPECIALS + VISION_SPECIALS`` and ``VL_CHAT_TEMPLATE``."""
    from hybridrl.data.char_tokenizer import build_char_tokenizer
    from hybridrl.data.chat_tokenizer import END

    return build_char_tokenizer(CHAT_CHARS, specials=CHAT_SPECIALS + VISION_SPECIALS, chat_template=VL_CHAT_TEMPLATE,
                                eos_token=END)


def vision_token_ids(tokenizer) -> dict[str, int]:
    """``image_token_id``, ``video_token_id``, ``vision_start_token_id``, ``vision_end_token_id``
    of a tokenizer that has Qwen's vision markers (a one-line ValueError otherwise)."""
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD), ("vision_start_token_id", VISION_START),
            ("vision_end_token_id", VISION_END))}
    if any(i is None or i == tokenizer.unk_token_id for i in ids.values()):
        raise ValueError(f"the tokenizer has no Qwen vision markers {VISION_SPECIALS}; a vision-language model needs "
                         "them (the built-in qwen2_5_vl / qwen3_vl tokenizer has them)")
    return ids
