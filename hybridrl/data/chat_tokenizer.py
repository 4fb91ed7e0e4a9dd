"""The built-in chat tokenizer: the character tokenizer over printable ASCII, with the chat
markers as single tokens and a short ChatML-style template that takes ``tools=``.

Invariants the agent machinery relies on (``agents/chat_render.py: check_template``):

- prefix-preserving: a conversation renders as its messages rendered one after another
  (no message is rewritten once later ones follow), so turns can be appended token-in/
  token-out;
- ``<|im_end|>`` ends every message; it is the end-of-turn token the episode runner stops on,
  and the tokenizer's eos (as in Qwen's chat tokenizers), so a turn has one stop token;
- ``<tool_call>`` / ``</tool_call>`` are one token each, so "call the tool" is one decision
  (one sampled token) for the policy.

The tools block is one line (``tools: add(a,b)``): the context is char-level, and every
character of a system prompt is a position the tiny model attends over in every turn.
"""

from __future__ import annotations

import string

IM_START, IM_END, TOOL_CALL, TOOL_CALL_END = "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"
CHAT_SPECIALS = (IM_START, IM_END, TOOL_CALL, TOOL_CALL_END)
# printable ASCII but the rare whitespace (\t \r \x0b \x0c); "\n" is kept: the template uses it
CHAT_CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")

CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\ntools: ' }}"
    "{%- for t in tools %}{{ t.function.name + '(' + (t.function.parameters.properties | list | join(',')) + ')' }}"
    "{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_chat_char_tokenizer():
    """The character tokenizer with ``CHAT_SPECIALS`` and ``CHAT_TEMPLATE`` (see the module docstring)."""
    from hybridrl.data.char_tokenizer import build_char_tokenizer

    return build_char_tokenizer(CHAT_CHARS, specials=CHAT_SPECIALS, chat_template=CHAT_TEMPLATE, eos_token=IM_END)
