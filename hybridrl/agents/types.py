"""The contract between the episode runner (the engine side) and the environments (the
world side): what an environment implements, and what one step of it returns.

A *message* is a chat-template message dict: ``{"role": "user" | "tool" | "system",
"content": str}`` (a tool message may carry ``"name"``). The runner renders each new
message on its own and appends its token ids to the trajectory; it never re-renders the
history (token-in/token-out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class Environment(Protocol):
    """A user environment (``env.name=path/to/env.py:ClassName``): one instance per episode,
    built with no arguments; it must pickle (its state travels to the worker process that
    runs each call)."""

    def reset(self, row: dict[str, Any]) -> list[dict]:
        """The episode's opening messages for a data row (its ``prompt``, ``answer``, ...)."""

    def step(self, assistant_message: str) -> tuple[list[dict], float, bool, dict]:
        """The model's turn (its text, end-of-turn token stripped) -> (new messages, reward of
        this turn, done, info). Raising, hanging past the timeout or killing the process
        is an *infrastructure* failure: the episode ends and is left out of training."""


@dataclass
class EnvStep:
    """What one reset or step of one episode's environment produced."""

    messages: list[dict] = field(default_factory=list)
    """messages to append (opening messages for a reset)."""
    reward: float = 0.0
    """this turn's reward (environments); tool environments score the final answer instead."""
    done: bool = False
    info: dict = field(default_factory=dict)
    failure: str | None = None
    """an infrastructure failure ("timeout", "worker died", "raised ValueError: ..."): the
    episode ends, marked failed, and is excluded from the advantage baseline."""
    tool_calls: int = 0
    """tool calls the turn made (tool environments)."""
    tool_errors: dict[str, int] = field(default_factory=dict)
    """tool call errors of the turn by kind ("malformed", "unknown tool", "bad arguments",
    "raised", "timeout", "crashed", "too many calls"): each cost that call, not the episode."""
    final_answer: str | None = None
    """tool environments, when done: the text the outcome reward scores."""
