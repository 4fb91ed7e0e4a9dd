import pytest

from hybridrl.rewards import REWARD_FNS, get_reward_fn, register_reward
from hybridrl.rewards.registry import is_batched, is_trusted


def test_builtin_exact_match_and_last_number():
    em = get_reward_fn("exact_match")
    assert em("82", "82", "37+45=") == 1.0 and em(" 82 ", 82, "") == 1.0 and em("8", "82", "") == 0.0
    ln = get_reward_fn("last_number")
    assert ln("so it is 12 then 42", "42", "") == 1.0 and ln("none", "42", "") == 0.0


def test_builtins_are_registered_with_their_trust():
    assert {"exact_match", "last_number", "gsm8k", "math_verify"} <= set(REWARD_FNS)
    assert is_trusted(get_reward_fn("gsm8k")) and is_trusted(get_reward_fn("exact_match"))
    # user-configurable regexes and sympy can run unbounded: they go to worker processes
    assert not is_trusted(get_reward_fn("math_verify")) and not is_trusted(get_reward_fn("format"))


def test_unknown_name_suggests():
    with pytest.raises(ValueError, match="did you mean 'exact_match'"):
        get_reward_fn("exact_mach")
    with pytest.raises(ValueError, match="did you mean 'gsm8k'"):
        get_reward_fn("gsm8kk")


def test_options_go_to_factories_only():
    fmt = get_reward_fn("format", pattern=r"^\d+$")
    assert fmt("42", None, "") == 1.0 and fmt("x42", None, "") == 0.0
    with pytest.raises(ValueError, match="'gsm8k' takes no options; remove pattern"):
        get_reward_fn("gsm8k", pattern="x")
    with pytest.raises(ValueError, match="unknown option.*patern.*it accepts pattern"):
        get_reward_fn("format", patern="x")


def test_user_function_from_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(response, answer, prompt):\n    return float(len(response))\n")
    fn = get_reward_fn(f"{f}:score")
    assert fn("abc", None, "") == 3.0
    assert fn.hybridrl_spec == f"{f.resolve()}:score"  # how a worker process loads it again
    with pytest.raises(ValueError, match="no callable"):
        get_reward_fn(f"{f}:nope")
    with pytest.raises(ValueError, match="not found"):
        get_reward_fn(f"{tmp_path}/missing.py:score")


def test_user_module_that_does_not_import():
    with pytest.raises(ValueError, match="cannot import no_such_module_xyz"):
        get_reward_fn("no_such_module_xyz:score")


def test_register_batched():
    @register_reward("test_batched_len", batched=True)
    def lengths(responses, answers, prompts):
        return [len(r) for r in responses]

    try:
        assert is_batched(get_reward_fn("test_batched_len")) and not is_trusted(lengths)
    finally:
        del REWARD_FNS["test_batched_len"]


@pytest.mark.parametrize("source, fragment", [
    ("def score(response, answer, prompt)\n    return 1.0\n", ":1: SyntaxError: expected ':'"),
    ("def score(r, a, p):\nreturn 1.0\n", ":2: IndentationError"),
    ("x = 1 / 0\ndef score(r, a, p):\n    return 1.0\n", "raised ZeroDivisionError: division by zero ("),
    ("import no_such_dependency_xyz\n", "failed: No module named 'no_such_dependency_xyz'; install it"),
    ("import sys\nsys.exit(3)\n", "raised SystemExit: 3"),
])
def test_reward_file_that_fails_to_import_is_one_line(tmp_path, source, fragment):
    f = tmp_path / "broken_reward.py"
    f.write_text(source)
    with pytest.raises(ValueError) as err:
        get_reward_fn(f"{f}:score")
    message = str(err.value)
    assert fragment in message and "\n" not in message and message.startswith(f"reward.functions='{f}:score'")


def test_reward_module_with_a_syntax_error_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_mod.py").write_text("def score(r, a, p)\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"broken_reward_mod.py:1: SyntaxError") as err:
        get_reward_fn("broken_reward_mod:score")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("spec", [":score", "file.py:", "module:"])
def test_spec_without_a_module_or_a_function(spec):
    with pytest.raises(ValueError, match="give path/to/file.py:fn or module:fn"):
        get_reward_fn(spec)
