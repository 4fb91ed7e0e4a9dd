"""Tool calls out of the model's text.

A parser is ``fn(text: str) -> ParsedTurn``: the turn's attempted calls *in the order they
appear* (each a :class:`ToolCall`, or a :class:`MalformedCall` with the reason it could not
be read) and the content outside them. Parsers are named in a registry (``"hermes"``,
the default) or given as ``path/to/file.py:fn`` / ``module:fn``.

Parsing runs in the trainer process (it is cheap and bounded); a parser must not raise on
any text (the tool environment turns a raise into a failed episode anyway).

Invariant: an attempted call that cannot be read is reported, never dropped, so the model
is told and the turn is not mistaken for a final answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from hybridrl.rewards.user_code import load_object
from hybridrl.did_you_mean import suggest


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MalformedCall:
    error: str
    """why it could not be read, for the model ("invalid JSON: ...")."""
    raw: str = ""
    """the text of the call as written."""
    name: str | None = None
    """the tool's name when that much could be read."""


@dataclass
class ParsedTurn:
    calls: list[ToolCall | MalformedCall] = field(default_factory=list)
    """every attempted call, valid or not, in order of appearance."""
    content: str = ""
    """the text outside the calls, stripped."""

    @property
    def valid(self) -> list[ToolCall]:
        return [c for c in self.calls if isinstance(c, ToolCall)]

    @property
    def errors(self) -> list[MalformedCall]:
        return [c for c in self.calls if isinstance(c, MalformedCall)]


ToolParser = Callable[[str], ParsedTurn]
PARSERS: dict[str, ToolParser] = {}


def register_parser(name: str):
    """Register ``fn(text) -> ParsedTurn`` under ``name``."""
    def deco(fn: ToolParser) -> ToolParser:
        PARSERS[name] = fn
        return fn
    return deco


_HERMES_FORMAT = '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


@register_parser("hermes")
def parse_hermes(text: str) -> ParsedTurn:
    """Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    any number per turn. ``arguments`` may be omitted (no arguments) or be a JSON string
    holding an object (the OpenAI wire form); an unclosed last tag is a malformed call."""
    calls: list[ToolCall | MalformedCall] = []
    outside: list[str] = []
    end = 0
    for match in _HERMES.finditer(text):
        outside.append(text[end:match.start()])
        end = match.end()
        body = match.group(1)
        if not match.group(2):
            calls.append(MalformedCall(f"unclosed <tool_call> tag; write {_HERMES_FORMAT}", body.strip()))
            continue
        calls.append(read_call(body))
    outside.append(text[end:])
    return ParsedTurn(calls, "".join(outside).strip())


def read_call(body: str) -> ToolCall | MalformedCall:
    """One call from its JSON text ``{"name": str, "arguments": object}``."""
    raw = body.strip()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        return MalformedCall(f"invalid JSON ({e}); write {_HERMES_FORMAT}", raw)
    if not isinstance(value, dict):
        return MalformedCall(f"the call is a JSON {type(value).__name__}, not an object; write {_HERMES_FORMAT}", raw)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(f'missing "name" (a string); write {_HERMES_FORMAT}', raw)
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # a JSON-encoded object, as in OpenAI's wire format
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return MalformedCall(f'"arguments" must be a JSON object of named arguments, got '
                             f'{type(arguments).__name__}; write {_HERMES_FORMAT}', raw, name)
    return ToolCall(name, arguments)


def get_parser(spec: str | ToolParser, *, where: str = "env.tool_parser") -> ToolParser:
    """A registered parser by name, a ``path/to/file.py:fn`` / ``module:fn``, or a callable as is."""
    if callable(spec):
        return spec
    if isinstance(spec, str) and spec in PARSERS:
        return PARSERS[spec]
    if isinstance(spec, str) and ":" in spec:
        fn, _ = load_object(spec, where, "a parser name or path/to/file.py:fn")
        if not callable(fn):
            raise ValueError(f"{where}={spec!r}: {spec.rpartition(':')[2]!r} is not a function; "
                             "give fn(text) -> ParsedTurn")
        return fn
    raise ValueError(f"{where}={spec!r}: unknown tool parser; {suggest(spec, PARSERS)} "
                     "(or give path/to/file.py:fn returning a ParsedTurn)")
