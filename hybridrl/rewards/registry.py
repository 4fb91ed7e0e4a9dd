"""Reward functions by name.

A reward function is ``fn(response: str, answer, prompt: str) -> float``. Built-ins are
registered here; a user function is named as ``path/to/file.py:function`` or
``package.module:function``.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any, Callable

RewardFn = Callable[[str, Any, str], float]
REWARD_FNS: dict[str, RewardFn] = {}

_NUMBER = re.compile(r"-?\d+")


def register_reward(name: str, *, trusted: bool = False):
    """Register ``fn`` under ``name``. ``trusted`` marks a pure, bounded-time function
    (the built-ins) that the runner may call inline, without a worker thread."""
    def deco(fn: RewardFn) -> RewardFn:
        fn.hybridrl_trusted = trusted
        REWARD_FNS[name] = fn
        return fn
    return deco


@register_reward("exact_match", trusted=True)
def exact_match(response: str, answer: Any, prompt: str = "") -> float:
    """1.0 when the stripped response equals the ground truth string, else 0.0."""
    return float(answer is not None and response.strip() == str(answer).strip())


@register_reward("last_number", trusted=True)
def last_number(response: str, answer: Any, prompt: str = "") -> float:
    """1.0 when the last integer in the response equals the answer (GSM8K-style)."""
    found = _NUMBER.findall(response)
    return float(bool(found) and answer is not None and found[-1] == str(answer).strip())


def _load_user_fn(spec: str) -> RewardFn:
    target, _, fn_name = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"reward.function {spec!r}: file {target} not found")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward.function {spec!r}: no callable {fn_name!r} in {target}")
    return fn


def get_reward_fn(name: str) -> RewardFn:
    """A built-in by name, or a user function given as ``file.py:fn`` / ``module:fn``."""
    if name in REWARD_FNS:
        return REWARD_FNS[name]
    if ":" in name:
        return _load_user_fn(name)
    close = difflib.get_close_matches(name, list(REWARD_FNS), n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"built-ins: {', '.join(REWARD_FNS)}"
    raise ValueError(f"reward.function={name!r} is unknown; {hint} (or give path/to/file.py:fn)")
