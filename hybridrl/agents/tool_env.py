"""The tool form of an environment (TRL style): a class whose public methods are tools.

One instance of the tools class per episode. A turn goes:

1. :meth:`ToolEnvironment.plan` parses the text. No attempted call at all: the episode is
   done, the text is its final answer (scored by the reward machinery, not here). Else
   each attempted call becomes a slot: a call to run (name known, arguments bind to the
   method's signature and match its schema's JSON types) or an immediate error
   ("malformed", "unknown tool", "bad arguments", "too many calls").
2. The calls run in order (:func:`run_tool`, here in-process, or one worker call each in
   ``env_pool.py``, where a timeout or a dead worker also becomes an error of that call).
3. :meth:`ToolEnvironment.finish` makes one tool message per slot, in order.

Invariant: a bad call costs that call only (an error text as its tool message, counted
in ``EnvStep.tool_errors``); it never ends the episode. Only the tools class itself being
unusable (no type hints, no docstring) is an error, raised when the environment is built.
"""

from __future__ import annotations

import inspect
import json
import pickle
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from hybridrl.agents.environment import environment_kind, load_environment, public_methods
from hybridrl.agents.tool_parsers import MalformedCall, ParsedTurn, ToolCall, ToolParser, get_parser
from hybridrl.agents.types import EnvStep

MALFORMED, UNKNOWN, BAD_ARGUMENTS, RAISED, TIMEOUT, CRASHED, TOO_MANY = (
    "malformed", "unknown tool", "bad arguments", "raised", "timeout", "crashed", "too many calls")
DEFAULT_MAX_TOOL_CALLS = 8


@dataclass(frozen=True)
class ToolOutcome:
    """What one attempted call produced: the tool message's content, and the error kind
    (None on success)."""

    content: str | list[dict]
    """text, or (a tool that returned pictures) content items ``{"type": "image", "image": ...}``
    / ``{"type": "text", "text": ...}`` that a vision-language policy's renderer turns into
    image placeholders (``agents/chat_render.py``)."""
    error: str | None = None


@dataclass
class TurnPlan:
    """A parsed turn: ``slots[i]`` is a :class:`ToolCall` to run or a ready :class:`ToolOutcome`."""

    text: str
    parsed: ParsedTurn
    slots: list[ToolCall | ToolOutcome] = field(default_factory=list)
    names: list[str | None] = field(default_factory=list)  # the tool name of each slot, when known

    @property
    def done(self) -> bool:
        return not self.slots

    def to_run(self) -> list[tuple[int, ToolCall]]:
        return [(i, s) for i, s in enumerate(self.slots) if isinstance(s, ToolCall)]


def _is_image(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.") and hasattr(value, "mode")  # PIL imported only by users of it


def tool_result_text(value: Any) -> str | list[dict]:
    """A tool's return value as message content: str() of it, JSON for dicts and lists; a
    PIL image (or a list holding some, text beside them) as content items."""
    if isinstance(value, str):
        return value
    if _is_image(value):
        return [{"type": "image", "image": value}]
    if isinstance(value, (list, tuple)) and any(_is_image(v) for v in value):
        return [{"type": "image", "image": v} if _is_image(v) else {"type": "text", "text": tool_result_text(v)}
                for v in value]
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def run_tool(instance: Any, call: ToolCall) -> ToolOutcome:
    """``instance.<name>(**arguments)`` as a ToolOutcome; never raises (a raise, SystemExit
    included, is a "raised" outcome). Runs wherever the tools run (a worker process)."""
    try:
        return ToolOutcome(tool_result_text(getattr(instance, call.name)(**call.arguments)))
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a tool's bug costs that call only
        # for the model: what went wrong, not where in the tool's source it went wrong
        return ToolOutcome(f"error: tool {call.name!r} raised {_one_line(e)}", RAISED)


def _one_line(error: BaseException) -> str:
    try:
        lines = str(error).strip().splitlines()
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises
        lines = []
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def opening_messages(row: dict, system_prompt: str | None = None) -> list[dict]:
    """``row["prompt"]`` as a user message (a string) or as the messages it is (a list),
    preceded by ``system_prompt`` unless the messages already open with a system message."""
    if not isinstance(row, dict) or "prompt" not in row:
        keys = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"tool environment: a data row needs a 'prompt' (a string or a list of messages); "
                         f"got {keys}; check data.prompt_key")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = [dict(m) for m in prompt]
    else:
        raise ValueError(f"tool environment: row['prompt'] is a {type(prompt).__name__}; give a string or a "
                         "list of {role, content} messages")
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def tool_schema(cls: type, name: str, fn: Callable) -> dict:
    """The OpenAI function schema of one tool, from its type hints and Google-style docstring."""
    from transformers.utils import get_json_schema  # heavy: only where schemas are built

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - TypeHintParsingException, DocstringParsingException, ...
        where = _where(fn)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip("!")
        raise ValueError(f"tool {cls.__qualname__}.{name}{where}: cannot describe it to the model ({why}); "
                         "give every argument a type hint and the method a Google-style docstring "
                         "with an Args: line per argument") from None
    schema["function"]["name"] = name  # the attribute name is what the model calls
    return schema


def _where(fn: Callable) -> str:
    try:
        return f" ({inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]})"
    except (OSError, TypeError):
        return ""


def _signature(cls: type, name: str) -> inspect.Signature:
    """The signature a call binds to: without ``self`` for a plain method."""
    attr = inspect.getattr_static(cls, name)
    sig = inspect.signature(getattr(cls, name))  # static/class methods: already without self/cls
    if inspect.isfunction(attr):
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


def _type_error(value: Any, schema: dict) -> str | None:
    """Why ``value`` does not match the schema's JSON type(s), or None (unknown forms pass)."""
    types = schema.get("type")
    if types is None:
        return None
    names = [types] if isinstance(types, str) else list(types)
    if schema.get("nullable"):
        names.append("null")
    for t in names:
        python = _JSON_TYPES.get(t)
        if python is None:
            return None
        if isinstance(value, python) and not (isinstance(value, bool) and t in ("integer", "number")):
            return None
    return f"expected {' or '.join(names)}, got {json.dumps(value)[:40]}"


class ToolEnvironment:
    """Tools class -> schemas, opening messages, and turns of tool calls.

    Used by ``EnvPool`` (parsing here, each call in a worker process) and usable on its own
    (``reset`` / ``step`` run the tools in this process, with no timeout)."""

    def __init__(self, tools: type | str, *, parser: str | ToolParser = "hermes",
                 max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS, system_prompt: str | None = None):
        if not (isinstance(max_tool_calls, int) and not isinstance(max_tool_calls, bool) and max_tool_calls >= 1):
            raise ValueError(f"env.max_tool_calls={max_tool_calls!r}: must be an integer >= 1")
        self.cls = load_environment(tools)
        if environment_kind(self.cls) != "tools":
            raise ValueError(f"env class {self.cls.__qualname__!r} has reset() and step(): it is an Environment, "
                             "not a tools class; use it as one (EnvPool does)")
        self.methods = public_methods(self.cls)
        self.parser = get_parser(parser)
        self.max_tool_calls = max_tool_calls
        self.system_prompt = system_prompt
        # built now: a tool the model cannot be told about is a config error, found before training
        self._schemas = [tool_schema(self.cls, name, fn) for name, fn in self.methods.items()]
        self._signatures = {name: _signature(self.cls, name) for name in self.methods}
        self._params = {s["function"]["name"]: s["function"]["parameters"].get("properties", {})
                        for s in self._schemas}
        self.instance: Any = None  # the in-process episode's tools (reset/step)

    def schemas(self) -> list[dict]:
        """The tools as OpenAI function JSON (``{"type": "function", "function": {...}}``),
        for the chat template's ``tools=``."""
        return [json.loads(json.dumps(s)) for s in self._schemas]  # a copy: callers may edit theirs

    def opening_messages(self, row: dict) -> list[dict]:
        return opening_messages(row, self.system_prompt)

    def plan(self, text: str) -> TurnPlan:
        """Parse a turn and decide each attempted call (see the module docstring)."""
        parsed = self.parser(text)
        if not isinstance(parsed, ParsedTurn):
            raise TypeError(f"tool parser returned {type(parsed).__name__}, not a ParsedTurn")
        plan = TurnPlan(text, parsed)
        for n, call in enumerate(parsed.calls):
            name = call.name
            if n >= self.max_tool_calls:
                slot = ToolOutcome(f"error: too many tool calls in one turn (at most {self.max_tool_calls}); "
                                   "this one was not run", TOO_MANY)
            elif isinstance(call, MalformedCall):
                slot = ToolOutcome(f"error: malformed tool call: {call.error}", MALFORMED)
            else:
                slot = self._check(call)
            plan.slots.append(slot)
            plan.names.append(name)
        return plan

    def _check(self, call: ToolCall) -> ToolCall | ToolOutcome:
        if call.name not in self.methods:
            return ToolOutcome(f"error: unknown tool {call.name!r}; the tools are {', '.join(self.methods)}", UNKNOWN)
        sig = self._signatures[call.name]
        try:
            sig.bind(**call.arguments)
        except TypeError as e:
            return ToolOutcome(f"error: bad arguments for {call.name!r}: {e}; it takes {call.name}{sig}",
                               BAD_ARGUMENTS)
        properties = self._params.get(call.name, {})
        for arg, value in call.arguments.items():
            why = _type_error(value, properties.get(arg, {}))
            if why:
                return ToolOutcome(f"error: bad arguments for {call.name!r}: {arg!r}: {why}", BAD_ARGUMENTS)
        return call

    def finish(self, plan: TurnPlan, outcomes: dict[int, ToolOutcome]) -> EnvStep:
        """The turn's EnvStep: the final answer when no call was attempted, else one tool
        message per slot (``outcomes[i]`` for the slots that ran)."""
        if plan.done:
            return EnvStep(done=True, final_answer=plan.text)
        messages, errors = [], Counter()
        for i, (slot, name) in enumerate(zip(plan.slots, plan.names)):
            outcome = slot if isinstance(slot, ToolOutcome) else outcomes[i]
            message = {"role": "tool", "content": outcome.content}
            if name:
                message["name"] = name
            messages.append(message)
            if outcome.error:
                errors[outcome.error] += 1
        return EnvStep(messages=messages, tool_calls=len(plan.slots), tool_errors=dict(errors))

    # in-process use (no isolation, no timeout; the instance must pickle, as in EnvPool):
    # EnvPool runs each call in a worker instead
    def reset(self, row: dict) -> list[dict]:
        self.instance = self.cls()
        return self.opening_messages(row)

    def step(self, text: str) -> EnvStep:
        if self.instance is None:
            raise RuntimeError("ToolEnvironment.step before reset(); call reset(row) first")
        plan = self.plan(text)
        outcomes = {}
        for i, call in plan.to_run():
            # as in EnvPool: a failed call leaves the state it started from
            before = pickle.dumps(self.instance, protocol=pickle.HIGHEST_PROTOCOL)
            outcomes[i] = run_tool(self.instance, call)
            if outcomes[i].error is not None:
                self.instance = pickle.loads(before)
        return self.finish(plan, outcomes)
