"""Reward functions by name.

A reward function is ``fn(response: str, answer, prompt: str) -> float`` (or a dict with
``score`` and extra metrics, see ``outcome.py``). A *batched* one is
``fn(responses, answers, prompts) -> list``, called once per batch. Built-ins are
registered here and in the task modules; a user function is named as
``path/to/file.py:function`` or ``package.module:function``. Rewards with options
(``format``'s pattern) also register a factory that builds them from keyword options.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any, Callable

RewardFn = Callable[..., Any]
REWARD_FNS: dict[str, RewardFn] = {}
REWARD_FACTORIES: dict[str, Callable[..., RewardFn]] = {}

_NUMBER = re.compile(r"-?\d+")


def register_reward(name: str, *, trusted: bool = False, batched: bool = False):
    """Register ``fn`` under ``name``. ``trusted`` marks a pure, bounded-time function
    (the built-ins) that the runner may call inline instead of in a worker process;
    ``batched`` marks ``fn(responses, answers, prompts) -> list``."""
    def deco(fn: RewardFn) -> RewardFn:
        fn.hybridrl_trusted = trusted
        if batched:
            fn.hybridrl_batched = True
        REWARD_FNS[name] = fn
        return fn
    return deco


def register_reward_factory(name: str):
    """Register ``factory(**options) -> reward`` so that specs can give ``name`` options."""
    def deco(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        REWARD_FACTORIES[name] = factory
        return factory
    return deco


def is_trusted(fn: RewardFn) -> bool:
    return bool(getattr(fn, "hybridrl_trusted", False))


def is_batched(fn: RewardFn) -> bool:
    return bool(getattr(fn, "hybridrl_batched", False))


def reward_label(fn: RewardFn) -> str:
    """A short name for metrics: the registered name, else the function's name."""
    for name, registered in REWARD_FNS.items():
        if registered is fn:
            return name
    return getattr(fn, "hybridrl_label", None) or getattr(fn, "__name__", type(fn).__name__)


@register_reward("exact_match", trusted=True)
def exact_match(response: str, answer: Any, prompt: str = "") -> float:
    """1.0 when the stripped response equals the ground truth string, else 0.0."""
    return float(answer is not None and response.strip() == str(answer).strip())


@register_reward("last_number", trusted=True)
def last_number(response: str, answer: Any, prompt: str = "") -> float:
    """1.0 when the last integer in the response equals the answer (GSM8K-style)."""
    found = _NUMBER.findall(response)
    return float(bool(found) and answer is not None and found[-1] == str(answer).strip())


def _load_user_fn(spec: str, where: str) -> RewardFn:
    target, _, fn_name = spec.rpartition(":")
    if not target or not fn_name:
        raise ValueError(f"{where}={spec!r}: give path/to/file.py:fn or module:fn")
    from hybridrl.rewards.user_code import load_module

    module, path = load_module(target, spec, where, what="reward")
    # a module loaded from a file is re-loaded by a worker process from its absolute path
    # (see process_pool.py); one importable by name is re-imported by plain pickling
    worker_spec = f"{path}:{fn_name}" if path is not None else None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{where}={spec!r}: no callable {fn_name!r} in {target}")
    if worker_spec is not None:
        fn.hybridrl_spec = worker_spec
    return fn


def _unknown(name: str, where: str) -> ValueError:
    known = sorted(set(REWARD_FNS) | set(REWARD_FACTORIES))
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"built-ins: {', '.join(known)}"
    return ValueError(f"{where}={name!r} is unknown; {hint} (or give path/to/file.py:fn or module:fn)")


def get_reward_fn(name: str, *, where: str = "reward.functions", **options: Any) -> RewardFn:
    """A built-in by name, or a user function given as ``file.py:fn`` / ``module:fn``.
    ``options`` go to the built-in's factory (e.g. ``get_reward_fn("format", pattern=...)``);
    ``where`` names the config field in error messages."""
    if options:
        factory = REWARD_FACTORIES.get(name)
        if factory is None:
            if name in REWARD_FNS or ":" in name:
                raise ValueError(f"{where}={name!r} takes no options; remove {', '.join(sorted(options))}")
            raise _unknown(name, where)
        params = inspect.signature(factory).parameters
        bad = sorted(map(str, set(options) - set(params)))
        if bad:
            raise ValueError(f"{where}={name!r}: unknown option(s) {', '.join(bad)}; it accepts {', '.join(params)}")
        try:
            return factory(**options)
        except ValueError as e:  # a bad option value: say which config entry it came from
            raise ValueError(f"{where}={name!r}: {e}") from None
    if name in REWARD_FNS:
        return REWARD_FNS[name]
    if name in REWARD_FACTORIES:
        return REWARD_FACTORIES[name]()
    if ":" in name:
        return _load_user_fn(name, where)
    raise _unknown(name, where)
