"""What runs inside a worker process for an environment: the pool's handlers.

Each handler is ``handler(cls, *args)`` (``cls``: the environment class, the pool's
payload) and returns only plain data (bytes, str, numbers, dicts, lists), so nothing of
the user's crosses back that the trainer would have to run. The episode's instance
travels as pickle bytes: unpickled here, used for one call, pickled again.

Invariant: a handler never raises (a raise in the worker's loop would kill the worker and
cost the other calls of its chunk): user errors come back as ``("failed", one line)``.
"""

from __future__ import annotations

import pickle
from typing import Any

from hybridrl.agents.tool_env import ToolCall, run_tool

OK, FAILED = "ok", "failed"


def _raised(e: BaseException, where: str) -> tuple[str, str]:
    from hybridrl.rewards.outcome import explain

    return FAILED, f"raised {explain(e)} in {where}"


def _dump(instance: Any, cls: type) -> bytes | tuple[str, str]:
    try:
        return pickle.dumps(instance, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - an open file, a lock, a generator in the state
        why = (str(e).strip().splitlines() or [""])[0]
        return FAILED, (f"state does not pickle: {type(e).__name__}: {why}; keep {cls.__qualname__}'s attributes "
                        "picklable (open files and connections in reset/step, not in the instance)")


def _check_messages(messages: Any, where: str) -> str | None:
    if not isinstance(messages, list):
        return f"bad result: {where} returned {type(messages).__name__} messages; return a list of message dicts"
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and _is_content(m.get("content"))):
            return (f"bad result: {where} returned the message {str(m)[:60]!r}; each message is "
                    '{"role": str, "content": str or a list of {"type": "text"|"image", ...} items}')
    return None


def _is_content(content: Any) -> bool:
    """Text, or content items (a VL policy's pictures: ``{"type": "image", "image": ...}``)."""
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(it, dict) and it.get("type") in ("text", "image")
                                             for it in content)


def env_reset(cls: type, row: dict) -> tuple:
    """``cls()`` then ``reset(row)`` -> ``("ok", state, messages)`` or ``("failed", why)``."""
    try:
        instance = cls()
        messages = instance.reset(row)
    except (Exception, SystemExit) as e:  # noqa: BLE001
        return _raised(e, f"{cls.__qualname__}.reset")
    bad = _check_messages(messages, f"{cls.__qualname__}.reset")
    if bad:
        return FAILED, bad
    state = _dump(instance, cls)
    return state if isinstance(state, tuple) else (OK, state, messages)


def env_step(cls: type, state: bytes, text: str) -> tuple:
    """One ``step(text)`` -> ``("ok", state, (messages, reward, done, info))`` or ``("failed", why)``."""
    from hybridrl.rewards.outcome import as_number

    where = f"{cls.__qualname__}.step"
    try:
        instance = pickle.loads(state)
        result = instance.step(text)
        if not (isinstance(result, tuple) and len(result) == 4):
            return FAILED, (f"bad result: {where} returned {type(result).__name__}; "
                            "return (messages, reward, done, info)")
        messages, reward, done, info = result
        reward_value, done_value = as_number(reward), bool(done)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - bool(done) and .item() run user code too
        return _raised(e, where)
    bad = _check_messages(messages, where)
    if bad:
        return FAILED, bad
    if reward_value is None:
        return FAILED, f"bad result: {where} returned the reward {str(reward)[:40]!r}; return a finite number"
    if not isinstance(info, dict):
        return FAILED, f"bad result: {where} returned info of type {type(info).__name__}; return a dict"
    state = _dump(instance, cls)
    return state if isinstance(state, tuple) else (OK, state, (messages, reward_value, done_value, info))


def tools_new(cls: type) -> tuple:
    """A fresh tools instance -> ``("ok", state)`` or ``("failed", why)``."""
    try:
        instance = cls()
    except (Exception, SystemExit) as e:  # noqa: BLE001
        return _raised(e, f"{cls.__qualname__}()")
    state = _dump(instance, cls)
    return state if isinstance(state, tuple) else (OK, state)


def tools_call(cls: type, state: bytes, name: str, arguments: dict) -> tuple:
    """One tool call -> ``("ok", new state or None when the call failed, ToolOutcome
    fields)`` or ``("failed", why)`` when the state itself is unusable."""
    try:
        instance = pickle.loads(state)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a __setstate__ that raises
        return _raised(e, f"unpickling {cls.__qualname__}")
    outcome = run_tool(instance, ToolCall(name, arguments))
    if outcome.error is not None:
        return OK, None, outcome.content, outcome.error  # a failed call keeps the state it started from
    new_state = _dump(instance, cls)
    if isinstance(new_state, tuple):
        return new_state
    return OK, new_state, outcome.content, None
