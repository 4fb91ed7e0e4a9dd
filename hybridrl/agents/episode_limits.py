"""What bounds an episode: turns, the context, each tool message (cut in the middle), and
each turn's sampling (one sample, stopping at the end-of-turn token).

Limits: ``max_turns`` sampled turns; each turn at most ``max_tokens`` (the sampling's);
a tool message longer than ``tool_response_tokens`` is cut in the middle with a marker (one
that fits exactly is kept); an episode that would outgrow ``context_tokens`` ends
``truncated``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hybridrl.agents.chat_render import ChatRenderer
from hybridrl.rollout.sampling_params import SamplingParams


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8
    """sampled turns per episode."""
    tool_response_tokens: int = 512
    """a tool message's content is cut to this many tokens (middle out, with a marker)."""
    context_tokens: int | None = None
    """prompt + every turn; None: the engine's max_seq_len."""

    def __post_init__(self):
        if self.max_turns < 1 or self.tool_response_tokens < 8:
            raise ValueError(f"EpisodeLimits: max_turns={self.max_turns} must be >= 1 and tool_response_tokens="
                             f"{self.tool_response_tokens} >= 8")


def truncate_middle(ids: list[int], budget: int, tokenizer: Any) -> tuple[list[int], str | None]:
    """``ids`` unchanged if they fit ``budget``; else head and tail around a marker, total <= budget.
    Returns (ids, the marker text or None)."""
    if len(ids) <= budget:
        return ids, None
    marker = f"\n[... {len(ids) - budget} tokens cut ...]\n"
    m = tokenizer.encode(marker, add_special_tokens=False)
    keep = max(0, budget - len(m))
    head = keep - keep // 2
    return ids[:head] + m + ids[len(ids) - keep // 2:] if keep // 2 else ids[:head] + m, marker


def turn_sampling(sampling: SamplingParams, renderer: ChatRenderer) -> SamplingParams:
    """A turn's sampling: one sample, stopping at the end-of-turn token too."""
    eot = renderer.end_of_turn_id
    stops = tuple(sampling.stop_token_ids) + (() if eot in sampling.stop_token_ids else (eot,))
    return dataclasses.replace(sampling, n=1, stop_token_ids=stops)


def budgeted(messages: list[dict], budget: int, tokenizer: Any) -> list[dict]:
    """Tool messages cut to ``budget`` tokens (middle out)."""
    out = []
    for m in messages:
        if m.get("role") == "tool" and isinstance(m.get("content"), str):
            ids = tokenizer.encode(m["content"], add_special_tokens=False)
            cut, marker = truncate_middle(ids, budget, tokenizer)
            if marker is not None:
                m = {**m, "content": tokenizer.decode(cut)}
        out.append(m)
    return out
