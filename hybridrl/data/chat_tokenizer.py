"""The built-in chat tokenizer: the character tokenizer over printable ASCII, with the chat
markers as single tokens and a short chat template (Phi-3 style role markers) that takes
``tools=`` and tool messages.

Invariants the agent machinery relies on (``agents/chat_render.py: check_template``):

- prefix-preserving: a conversation renders as its messages rendered one after another
  (no message is rewritten once later ones follow), so turns can be appended token-in/
  token-out;
- ``<|end|>`` ends every message; it is the end-of-turn token the episode runner stops on,
  and the tokenizer's eos (as in chat tokenizers), so a turn has one stop token;
- ``<tool_call>`` / ``</tool_call>`` are one token each, so "call the tool" is one decision
  (one sampled token) for the policy.

Why so terse (one token per role marker, no newlines, a one-line tools block
``tools: add(a,b)``): the context is char-level, and on a CPU every character of every
episode is paid for in sampling and in training.
"""

from __future__ import annotations

import string

END, TOOL_CALL, TOOL_CALL_END = "<|end|>", "<tool_call>", "</tool_call>"
ROLES = ("system", "user", "assistant", "tool")
CHAT_SPECIALS = tuple(f"<|{r}|>" for r in ROLES) + (END, TOOL_CALL, TOOL_CALL_END)
# printable ASCII but the rare whitespace (\t \r \x0b \x0c)
CHAT_CHARS = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")

CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|system|>tools: ' }}"
    "{%- for t in tools %}{{ t.function.name + '(' + (t.function.parameters.properties | list | join(',')) + ')' }}"
    "{%- if not loop.last %}{{ ', ' }}{%- endif %}{%- endfor %}{{ '<|end|>' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|' + m.role + '|>' + m.content + '<|end|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{%- endif %}"
)


def build_chat_char_tokenizer():
    """The character tokenizer with ``CHAT_SPECIALS`` and ``CHAT_TEMPLATE`` (see the module docstring)."""
    from hybridrl.data.char_tokenizer import build_char_tokenizer

    return build_char_tokenizer(CHAT_CHARS, specials=CHAT_SPECIALS, chat_template=CHAT_TEMPLATE, eos_token=END)
