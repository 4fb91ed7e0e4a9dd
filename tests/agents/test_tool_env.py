"""ToolEnvironment in this process: schemas, opening messages, a turn of calls."""

from pathlib import Path

import pytest

from hybridrl.agents.tool_env import ToolEnvironment, opening_messages

HELPERS = Path(__file__).parent / "envs_for_tests.py"


def spec(name: str) -> str:
    return f"{HELPERS}:{name}"


@pytest.fixture(scope="module")
def toolbox() -> ToolEnvironment:
    return ToolEnvironment(spec("Toolbox"), max_tool_calls=3)


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_schemas_from_signatures_and_docstrings(toolbox):
    schemas = {s["function"]["name"]: s for s in toolbox.schemas()}
    assert list(schemas) == ["add", "increment", "fail", "hang", "shout", "crash", "lookup"]
    assert schemas["add"] == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "integer", "description": "The second number."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "integer"},
        },
    }
    assert schemas["increment"] == {
        "type": "function",
        "function": {"name": "increment", "description": "Add one to the counter and return it.",
                     "parameters": {"type": "object", "properties": {}}, "return": {"type": "integer"}},
    }
    assert schemas["lookup"]["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "key": {"type": "string", "description": "The key."},
            "default": {"type": "string", "nullable": True, "description": "What to return when it is missing."},
        },
        "required": ["key"],
    }
    schemas["add"]["function"]["name"] = "edited"
    assert toolbox.schemas()[0]["function"]["name"] == "add"  # callers get copies


@pytest.mark.parametrize("name, fragment", [
    ("NoDocstring", "no docstring"),
    ("NoTypeHint", "Argument a is missing a type hint"),
])
def test_a_tool_the_model_cannot_be_told_about_is_a_one_line_error(name, fragment):
    with pytest.raises(ValueError) as info:
        ToolEnvironment(spec(name))
    message = str(info.value)
    assert "\n" not in message and fragment in message and f"tool {name}.add (" in message
    assert "envs_for_tests.py:" in message and "Google-style docstring" in message


def test_an_environment_class_is_not_a_tools_class():
    with pytest.raises(ValueError, match="it is an Environment, not a tools class"):
        ToolEnvironment(spec("GuessNumber"))


def test_opening_messages():
    assert opening_messages({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    assert opening_messages({"prompt": "hi"}, "Use tools.") == [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "hi"}]
    given = [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]
    assert opening_messages({"prompt": given}, "Use tools.") == given  # the row's own system prompt wins
    with pytest.raises(ValueError, match="needs a 'prompt'.*got question, answer"):
        opening_messages({"question": "q", "answer": 1})
    with pytest.raises(ValueError, match=r"row\['prompt'\] is a int"):
        opening_messages({"prompt": 3})


def test_a_turn_in_process(toolbox):
    assert toolbox.reset({"prompt": "count"}) == [{"role": "user", "content": "count"}]
    step = toolbox.step("ok " + call("increment") + call("add", a=1, b="2") + call("nope") + call("increment"))
    assert not step.done and step.tool_calls == 4
    assert [m["content"] for m in step.messages][:1] == ["1"]
    assert step.messages[1]["content"].startswith("error: bad arguments for 'add': 'b': expected integer")
    assert step.messages[2]["content"].startswith("error: unknown tool 'nope'; the tools are add, increment")
    assert "too many tool calls" in step.messages[3]["content"]
    assert all(m["role"] == "tool" for m in step.messages)
    assert step.tool_errors == {"bad arguments": 1, "unknown tool": 1, "too many calls": 1}
    step = toolbox.step(call("add", a=1) + call("fail", message="boom") + call("lookup", key="apple"))
    assert "missing a required argument: 'b'" in step.messages[0]["content"]
    assert step.messages[1]["content"] == "error: tool 'fail' raised ValueError: boom"
    # as in EnvPool, fail's change to the count was rolled back
    assert step.messages[2]["content"] == '{"key": "apple", "value": "red", "count": 1}'
    final = toolbox.step("The answer is 2.")
    assert final.done and final.final_answer == "The answer is 2." and final.messages == []


def test_a_broken_parser_result_is_a_type_error():
    env = ToolEnvironment(spec("Toolbox"), parser=lambda text: "not a turn")
    with pytest.raises(TypeError, match="not a ParsedTurn"):
        env.plan("x")


def test_max_tool_calls_is_checked():
    with pytest.raises(ValueError, match="env.max_tool_calls=0: must be an integer >= 1"):
        ToolEnvironment(spec("Toolbox"), max_tool_calls=0)
