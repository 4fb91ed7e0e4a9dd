"""GSM8K-style reward: the model's final number equals the ground truth's, numerically.

The model's answer is the first number after its last ``####`` marker, else inside its
last ``\\boxed{...}``, else after its last "the answer is". The ground truth is the
number after ``####`` in a GSM8K solution, or the whole answer when it has no marker.
Numbers compare exactly as fractions after dropping ``$``, thousands commas and spaces,
and reading the Unicode minus as ``-``: "1,234" == "1234" == "$1,234.00", "−5" == "-5".
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from hybridrl.rewards.registry import register_reward

# sign, optional (escaped) $ with the sign before or after it, digits with thousands
# commas, then decimals or a /denominator. Only bounded optional pieces precede the
# digits, so a search is linear in the text (this reward runs inline, untimed).
_NUMBER = re.compile(r"([-−+]?) ?\\?\$? ?([-−]?)(\d[\d,]*(?:\.\d+)?(?:/\d+)?)")
_MARKER = "####"
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer\s+is\b", re.IGNORECASE)


def parse_number(text: str) -> Fraction | None:
    """The first number in ``text`` as an exact Fraction, or None when there is none."""
    found = _NUMBER.search(text)
    if found is None:
        return None
    sign, sign_after_dollar, digits = found.groups()
    try:
        value = Fraction(digits.replace(",", ""))
    except (ValueError, ZeroDivisionError):  # "3/0"
        return None
    negative = (sign in ("-", "−")) != (sign_after_dollar in ("-", "−"))
    return -value if negative else value


def extract_answer(response: str) -> Fraction | None:
    """The model's final answer: after ``####``, else in ``\\boxed{}``, else after "answer is"."""
    if _MARKER in response:
        return parse_number(response.rsplit(_MARKER, 1)[1])
    boxed = _BOXED.findall(response)
    if boxed:
        return parse_number(boxed[-1])
    said = list(_ANSWER_IS.finditer(response))
    if said:
        return parse_number(response[said[-1].end():].split("\n", 1)[0])
    return None


def ground_truth(answer: Any) -> Fraction | None:
    """The reference number: after ``####`` in a GSM8K solution, else the whole answer."""
    if answer is None:
        return None
    text = str(answer)
    return parse_number(text.rsplit(_MARKER, 1)[1] if _MARKER in text else text)


@register_reward("gsm8k", trusted=True)
def gsm8k(response: str, answer: Any, prompt: str = "") -> float:
    """1.0 when the response's final number equals the ground truth's, else 0.0."""
    truth = ground_truth(answer)
    return float(truth is not None and extract_answer(response) == truth)
