"""Reading a judge model's answer: a number from its text, or the odds of a verdict token.

``number``: the judge writes a grade (``"Score: 7/10"``); the score is the number after the
last "score" in the text (else the last number of the text), divided by its written
denominator (``7/10``) or else by ``scale``, and must land in [0, 1]; anything else is
unreadable (``None``, which the reward counts as "judge unparseable").

``verdict``: no text at all. One forward of the judge over the rendered prompt gives the
next-token logits ``z`` at the first answer position, and the score is

    P(yes) / (P(yes) + P(no)) = exp(z_yes) / (exp(z_yes) + exp(z_no)) = sigmoid(z_yes - z_no)

(the softmax's normalizer cancels, so only the two logits matter). The verdict words are
tokenized; when their token ids start alike (a char tokenizer's " Yes" / " No" share the
space) the shared tokens are appended to the prompt, so the logits are read where the two
words first differ.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_GRADE = re.compile(rf"({_NUMBER})(?:\s*/\s*({_NUMBER}))?")
_SCORE_WORD = re.compile(r"score", re.IGNORECASE)

UNPARSEABLE = "judge unparseable"


def parse_number(text: str, scale: float) -> float | None:
    """The grade in ``text`` as a score in [0, 1], or None when there is none (see the module doc)."""
    words = list(_SCORE_WORD.finditer(text))
    tail = text[words[-1].end():] if words else text
    grades = list(_GRADE.finditer(tail))
    if not grades:
        return None
    grade = grades[0] if words else grades[-1]
    value, denominator = float(grade.group(1)), grade.group(2)
    denominator = float(denominator) if denominator is not None else scale
    if denominator <= 0:
        return None
    score = value / denominator
    return score if 0.0 <= score <= 1.0 else None


@dataclass(frozen=True)
class VerdictTokens:
    """Where the verdict is read: ``prefix`` (token ids both verdict words start with, appended
    to the prompt), then the first token of each word after it."""

    prefix: tuple[int, ...]
    yes: int
    no: int


def verdict_tokens(tokenizer, yes: str, no: str) -> VerdictTokens:
    """The tokens of the words ``yes`` / ``no`` as a continuation (no special tokens).
    ValueError when they cannot be told apart by a first differing token."""
    a = tokenizer.encode(yes, add_special_tokens=False)
    b = tokenizer.encode(no, add_special_tokens=False)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if n == len(a) or n == len(b):
        raise ValueError(f"verdicts=[{yes!r}, {no!r}]: one word's tokens {a} start the other's {b}, so no "
                         "token tells them apart; pick two words that differ in a token")
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and (a[n] == unk or b[n] == unk):
        raise ValueError(f"verdicts=[{yes!r}, {no!r}]: the judge tokenizer cannot spell them (unknown token); "
                         "pick words in its vocabulary")
    return VerdictTokens(tuple(a[:n]), a[n], b[n])


def verdict_probability(logit_yes: float, logit_no: float) -> float:
    """``sigmoid(z_yes - z_no)`` in float64 (= P(yes) / (P(yes) + P(no)) under the softmax)."""
    d = float(logit_yes) - float(logit_no)
    if d >= 0:
        return 1.0 / (1.0 + math.exp(-d))
    e = math.exp(d)
    return e / (1.0 + e)
