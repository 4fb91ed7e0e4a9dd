"""The judge's prompt: a format string rendered per sample, tokenized with the judge's own
tokenizer (through its chat template when it has one, as the single user turn).

Fields: ``{question}`` (the policy's prompt), ``{response}`` (what it answered),
``{reference}`` (the sample's ground truth, "" when none) and ``{rubric}`` (the judge's
``rubric`` option, the same for every sample). ``DEFAULT_TEMPLATE`` is short on purpose:
a character-level judge (``scripts/train_judge.py``) reads every character as a token.

Everything before the first per-sample field renders to the same tokens for every
sample (the template's head, the rubric, a chat template's header): ``shared_prefix``
finds it, so the server can prefill it once and let every request continue from it.
"""

from __future__ import annotations

import string

DEFAULT_TEMPLATE = "{rubric}Q: {question} A: {response} Correct?"
FIELDS = ("question", "response", "reference", "rubric")


def check_template(template: str) -> None:
    """ValueError (one line) for a template with unknown fields, positional fields, or no ``{response}``."""
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"template={template!r}: not a format string ({e}); write fields as {{response}} "
                         "and literal braces as {{{{ }}}}") from None
    bad = sorted({n for n in names if n not in FIELDS})
    if bad:
        raise ValueError(f"template={template!r}: unknown field(s) {', '.join('{' + n + '}' for n in bad)}; "
                         f"use {', '.join('{' + f + '}' for f in FIELDS)}")
    if "response" not in names:
        raise ValueError(f"template={template!r}: has no {{response}}, so the judge never sees the answer; add it")


class JudgePrompt:
    """Renders and tokenizes one judge prompt per sample; ``suffix``: token ids appended after
    the rendered prompt (a verdict's shared leading tokens)."""

    def __init__(self, tokenizer, template: str, rubric: str, suffix: tuple[int, ...] = ()):
        check_template(template)
        self.tokenizer, self.template, self.rubric, self.suffix = tokenizer, template, rubric, list(suffix)
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def text(self, question: str, response: str, reference: str) -> str:
        return self.template.format(question=question, response=response, reference=reference, rubric=self.rubric)

    def token_ids(self, question: str, response: str, reference: str) -> list[int]:
        text = self.text(question, response, reference)
        if self.chat:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                     add_generation_prompt=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = self.tokenizer(text)["input_ids"]  # with the tokenizer's own specials (<bos>)
        return [int(t) for t in ids] + self.suffix

    def shared_prefix(self) -> list[int]:
        """The leading token ids every sample's prompt has (two renders with other fields agree on them)."""
        a, b = self.token_ids("1", "1", "1"), self.token_ids("2", "2", "2")
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return a[:n]

    def check_spelling(self, where: str) -> None:
        """ValueError (one line) when the template or rubric holds characters the tokenizer
        maps to its unknown token (a character-level tokenizer with a small alphabet)."""
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if unk is None:
            return
        fixed = self.text("", "", "")
        bad = sorted({ch for ch in fixed if unk in self.tokenizer.encode(ch, add_special_tokens=False)})
        if bad:
            raise ValueError(f"template/rubric: the judge tokenizer at {where} cannot spell {''.join(bad)!r} "
                             "(unknown token); write the template in its alphabet or retrain the judge with these "
                             "characters")
