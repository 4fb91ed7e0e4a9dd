"""Tool-call parsing: the Hermes format, malformed calls, pluggable parsers."""

from pathlib import Path

import pytest

from hybridrl.agents.tool_parsers import MalformedCall, ToolCall, get_parser, parse_hermes

HELPERS = Path(__file__).parent / "envs_for_tests.py"


def test_two_calls_and_the_content_around_them():
    text = ('Let me compute. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
            '<tool_call>\n{"name": "lookup", "arguments": {"key": "apple"}}\n</tool_call> Done.')
    turn = parse_hermes(text)
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("lookup", {"key": "apple"})]
    assert turn.errors == []
    assert turn.content == "Let me compute. \n Done."


def test_no_call_is_content_only():
    turn = parse_hermes("The answer is 42.")
    assert turn.calls == [] and turn.content == "The answer is 42."


@pytest.mark.parametrize("body, error, name", [
    ('{"name": "add", "arguments": {"a": 1,}}', "invalid JSON", None),
    ('{"arguments": {"a": 1}}', 'missing "name"', None),
    ('{"name": "", "arguments": {}}', 'missing "name"', None),
    ('{"name": "add", "arguments": [1, 2]}', '"arguments" must be a JSON object', "add"),
    ('["add"]', "JSON list, not an object", None),
])
def test_malformed_calls_are_reported_in_order(body, error, name):
    text = f'<tool_call>{body}</tool_call><tool_call>{{"name": "increment"}}</tool_call>'
    turn = parse_hermes(text)
    assert len(turn.calls) == 2
    bad, good = turn.calls
    assert isinstance(bad, MalformedCall) and error in bad.error and bad.name == name and bad.raw == body
    assert "<tool_call>" in bad.error  # tells the model the format
    assert good == ToolCall("increment", {})  # arguments omitted: none
    assert turn.valid == [good] and turn.errors == [bad]


def test_arguments_as_a_json_string_and_an_unclosed_tag():
    turn = parse_hermes('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
                        'then <tool_call>{"name": "add", "argu')
    assert turn.calls[0] == ToolCall("add", {"a": 1, "b": 2})
    assert isinstance(turn.calls[1], MalformedCall) and "unclosed <tool_call>" in turn.calls[1].error
    assert turn.content == "then"


def test_parsers_by_name_and_by_path():
    assert get_parser("hermes") is parse_hermes
    custom = get_parser(f"{HELPERS}:parse_call_lines")
    turn = custom('thinking\nCALL {"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2})] and turn.content == "thinking"


@pytest.mark.parametrize("spec, fragment", [
    ("hermez", "did you mean 'hermes'?"),
    (f"{HELPERS}:History_nope", "no 'History_nope' in"),
    ("missing/parser.py:fn", "file missing/parser.py not found"),
])
def test_bad_parser_specs_are_one_line(spec, fragment):
    with pytest.raises(ValueError) as info:
        get_parser(spec)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith("env.tool_parser=")
