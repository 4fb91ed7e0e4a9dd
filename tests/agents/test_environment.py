"""load_environment / environment_kind / dumps_env_class: specs, kinds, one-line errors."""

import pickle
from pathlib import Path

import pytest

from hybridrl.agents.environment import dumps_env_class, environment_kind, load_environment, public_methods

HELPERS = Path(__file__).parent / "envs_for_tests.py"


def spec(name: str) -> str:
    return f"{HELPERS}:{name}"


def one_line_error(call, *fragments: str) -> str:
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_class_from_a_file_carries_its_spec_and_loads_once():
    cls = load_environment(spec("GuessNumber"))
    assert cls.__name__ == "GuessNumber"
    assert cls.hybridrl_spec == f"{HELPERS.resolve()}:GuessNumber"
    assert load_environment(spec("GuessNumber")) is cls  # the file is a registered module: loaded once
    assert load_environment(cls) is cls


def test_a_class_from_a_module_pickles_by_name():
    cls = load_environment("collections:OrderedDict")
    assert "hybridrl_spec" not in vars(cls)
    assert pickle.loads(dumps_env_class(cls)) is cls


def test_a_file_class_travels_as_its_spec():
    cls = load_environment(spec("Toolbox"))
    payload = dumps_env_class(cls)
    assert str(HELPERS.resolve()).encode() in payload  # the spec, not the class by its module name
    assert pickle.loads(payload) is cls


def test_kinds():
    assert environment_kind(load_environment(spec("GuessNumber"))) == "environment"
    toolbox = load_environment(spec("Toolbox"))
    assert environment_kind(toolbox) == "tools"
    assert list(public_methods(toolbox)) == ["add", "increment", "fail", "hang", "shout", "crash", "lookup"]
    one_line_error(lambda: environment_kind(load_environment(spec("Empty"))), "'Empty'", "neither reset() and step()")


def test_spec_errors_are_one_line():
    one_line_error(lambda: load_environment("no/such/env.py:Env"), "env.name=", "file no/such/env.py not found")
    one_line_error(lambda: load_environment(spec("Nope")), "no 'Nope' in", "GuessNumber", "Toolbox")
    one_line_error(lambda: load_environment(spec("not_a_class")), "is a function, not a class")
    one_line_error(lambda: load_environment("just_a_name"), "give path/to/env.py:ClassName")
    one_line_error(lambda: load_environment("no_such_module_xyz:Env"), "cannot import no_such_module_xyz")
    one_line_error(lambda: load_environment(42), "env.name=42")


def test_a_file_that_fails_to_import_is_one_line(tmp_path):
    broken = tmp_path / "broken_env.py"
    broken.write_text("class Env:\n    def reset(self, row)\n")
    one_line_error(lambda: load_environment(f"{broken}:Env"), "SyntaxError", "broken_env.py:2")
    raising = tmp_path / "raising_env.py"
    raising.write_text("raise RuntimeError('no GPU here')\n")
    one_line_error(lambda: load_environment(f"{raising}:Env"), "raised RuntimeError: no GPU here", "raising_env.py:1")


def test_a_class_that_a_worker_cannot_import_is_refused():
    class Local:
        def ping(self) -> str:
            """Pong."""
            return "pong"

    one_line_error(lambda: dumps_env_class(Local), "cannot be sent to a worker process", "path/to/env.py:ClassName")
