"""Greedy continuations compared the way rounding allows.

Two correct implementations (the engine and transformers, or one engine at two batch
compositions) compute each logit as float32 sums in different orders, so logits differ by a
few ulps of their magnitude. Where the two best logits are closer than that (a near-tie), the
argmax may legitimately differ, and after it the continuations do; anywhere else a different
token is a bug. ``ROUNDING_ULPS`` of the largest logit is the allowance (the engine-vs-
transformers logit gaps measured in tests/trainer/test_prefix_consistency.py: <= 8 ulps).
"""
from __future__ import annotations

import torch

ROUNDING_ULPS = 32


def rounding_margin(logits: torch.Tensor) -> float:
    return ROUNDING_ULPS * torch.finfo(torch.float32).eps * float(logits.abs().max())


@torch.no_grad()
def assert_greedy_matches(model, prompt: list[int], tokens: list[int],
                          tie_margin: float | list[float] | None = None, what: str = "") -> None:
    """``tokens`` is ``model``'s greedy continuation of ``prompt`` (transformers' full forward,
    one token at a time): at each step the argmax, or a token whose logit is within the margin
    of it — ``tie_margin`` (one, or one per step) or, by default, the rounding margin of that
    step's logits — after which the comparison stops."""
    ids = list(prompt)
    margins = tie_margin if isinstance(tie_margin, list) else [tie_margin] * len(tokens)
    for i, (t, margin) in enumerate(zip(tokens, margins)):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        margin = rounding_margin(logits) if margin is None else margin
        best = int(logits.argmax())
        if t != best:
            gap = float(logits[best] - logits[t])
            assert gap < margin, (f"{what} step {i}: engine chose {t}, transformers {best} (logit gap {gap:.3g}, "
                                  f"margin {margin:.3g}); prompt {prompt}, tokens {tokens}")
            return
        ids.append(t)
