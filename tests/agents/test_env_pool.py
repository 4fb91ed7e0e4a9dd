"""EnvPool with real worker processes (no mocks): tools that misbehave cost that call,
environments keep state between calls, infrastructure failures end the episode, close()
and garbage collection leave no process behind."""

import gc
import json
import math
import os
from pathlib import Path

import pytest

from hybridrl.agents.env_pool import EnvPool

HELPERS = Path(__file__).parent / "envs_for_tests.py"


def spec(name: str) -> str:
    return f"{HELPERS}:{name}"


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def tools():
    with EnvPool(spec("Toolbox"), workers=2, timeout_s=1, max_tool_calls=4, system_prompt="Use the tools.") as pool:
        yield pool


@pytest.fixture(scope="module")
def envs():
    with EnvPool(spec("Misbehaving"), workers=2, timeout_s=1) as pool:
        yield pool


_ids = iter(range(10**6))


def start(pool: EnvPool, row=None) -> str:
    episode = f"e{next(_ids)}"
    (opening,) = pool.reset([episode], [row or {"prompt": "count"}])
    assert opening.failure is None, opening.failure
    return episode


def contents(step) -> list[str]:
    return [m["content"] for m in step.messages]


# ------------------------------------------------------------------------------------ tools

def test_tools_pool_basics(tools):
    assert tools.kind == "tools"
    assert [s["function"]["name"] for s in tools.schemas] == ["add", "increment", "fail", "hang", "shout", "crash",
                                                              "lookup"]
    (opening,) = tools.reset(["opening"], [{"prompt": "What is 1+2?"}])
    assert opening.messages == [{"role": "system", "content": "Use the tools."},
                                {"role": "user", "content": "What is 1+2?"}]
    assert not opening.done and opening.failure is None
    (step,) = tools.step([("opening", call("add", a=1, b=2))])
    assert step.messages == [{"role": "tool", "name": "add", "content": "3"}]
    assert step.tool_calls == 1 and step.tool_errors == {} and not step.done
    (final,) = tools.step([("opening", "It is 3.")])
    assert final.done and final.final_answer == "It is 3." and final.failure is None
    assert "opening" not in tools.running  # done: forgotten
    tools.end("opening")  # a no-op now


@pytest.mark.parametrize("bad_call, kind, content", [
    (call("fail", message="boom"), "raised", "error: tool 'fail' raised ValueError: boom"),
    (call("hang", seconds=60), "timeout", "error: tool 'hang' timed out after 1 s and was stopped"),
    (call("crash", code=3), "crashed", "error: tool 'crash' crashed (exited with code 3); its effects are lost"),
    (call("shout", megabytes=5), None, "done shouting"),  # 5 MB to stdout: /dev/null
    (call("lookup", key="apple"), None, '{"key": "apple", "value": "red", "count": 1}'),
    ("<tool_call>{'name': 'add'}</tool_call>", "malformed", "error: malformed tool call: invalid JSON"),
    (call("nope"), "unknown tool", "error: unknown tool 'nope'"),
    (call("add", a=1), "bad arguments", "error: bad arguments for 'add': missing a required argument: 'b'"),
])
def test_a_misbehaving_call_costs_that_call_only(tools, bad_call, kind, content):
    episode = start(tools)
    pids = set(tools.pids())
    (step,) = tools.step([(episode, call("increment") + bad_call + call("increment"))])
    assert not step.done and step.failure is None
    assert step.tool_calls == 3
    assert step.tool_errors == ({kind: 1} if kind else {})
    first, bad, last = step.messages
    assert first == {"role": "tool", "name": "increment", "content": "1"}
    assert bad["role"] == "tool" and bad["content"].startswith(content), bad
    # the calls of one episode run in order, on the state the previous call left; a failed
    # call keeps the state it started from (fail's +100 is gone, so is whatever crash did)
    assert last == {"role": "tool", "name": "increment", "content": "2"}
    if kind in ("timeout", "crashed"):
        assert set(tools.pids()) != pids  # the worker was replaced
    # the episode and the pool go on
    (step,) = tools.step([(episode, call("increment"))])
    assert contents(step) == ["3"] and step.tool_errors == {}
    tools.end(episode)
    assert episode not in tools.running


def test_too_many_calls_and_several_episodes_at_once(tools):
    a, b, c = start(tools), start(tools), start(tools)
    steps = tools.step([
        (a, "".join(call("increment") for _ in range(6))),
        (b, call("hang", seconds=60) + call("increment")),
        (c, "no call: the final answer"),
    ])
    assert contents(steps[0]) == ["1", "2", "3", "4"] + ["error: too many tool calls in one turn (at most 4); "
                                                         "this one was not run"] * 2
    assert steps[0].tool_calls == 6 and steps[0].tool_errors == {"too many calls": 2}
    assert steps[1].tool_errors == {"timeout": 1} and contents(steps[1])[1] == "1"
    assert steps[2].done and steps[2].final_answer == "no call: the final answer"
    assert sorted(set(tools.running) & {a, b, c}) == sorted([a, b])
    (step,) = tools.step([(a, call("lookup", key="pear", default="none"))])
    assert json.loads(contents(step)[0]) == {"key": "pear", "value": "none", "count": 4}
    for episode in (a, b):
        tools.end(episode)


def test_a_tools_instance_that_cannot_pickle_fails_the_episode():
    with EnvPool(spec("LocksInState"), workers=1, timeout_s=1) as pool:
        (opening,) = pool.reset(["x"], [{"prompt": "ping"}])
        assert opening.done and opening.failure.startswith("state does not pickle: TypeError")
        assert "x" not in pool.running


# ------------------------------------------------------------------------------ environments

def test_an_environment_keeps_its_state_between_calls():
    with EnvPool(spec("GuessNumber"), workers=2, timeout_s=1) as pool:
        assert pool.kind == "environment" and pool.schemas is None
        openings = pool.reset(["a", "b"], [{"answer": 3}, {"answer": 8}])
        assert [o.messages for o in openings] == [[{"role": "user", "content": "Guess my number (1-10)."}]] * 2
        a, b = pool.step([("a", "5"), ("b", "5")])
        assert (contents(a), a.reward, a.done, a.info) == (["lower"], 0.0, False, {"tries": 1})
        assert (contents(b), b.reward, b.done, b.info) == (["higher"], 0.0, False, {"tries": 1})
        a, b = pool.step([("a", "2"), ("b", "8")])
        assert (contents(a), a.info) == (["higher"], {"tries": 2})
        assert (b.messages, b.reward, b.done, b.info) == ([], 1.0, True, {"tries": 2})
        assert pool.running == ["a"]
        (a,) = pool.step([("a", "3")])
        assert (a.reward, a.done, a.info, a.failure) == (1.0, True, {"tries": 3}, None)
        assert pool.running == []


@pytest.mark.parametrize("text, failure", [
    ("raise", "raised ValueError: step failed on purpose ("),
    ("hang", "timeout: no result within 1 s"),
    ("exit", "worker died: the worker process exited with code 3"),
    ("bad result", "bad result: Misbehaving.step returned str; return (messages, reward, done, info)"),
    ("bad message", "bad result: Misbehaving.step returned the message"),
    ("lock", "state does not pickle: TypeError"),
])
def test_an_environment_failure_ends_that_episode_only(envs, text, failure):
    bad, good = start(envs), start(envs)
    steps = envs.step([(bad, text), (good, "fine")])
    assert steps[0].done and steps[0].failure.startswith(failure), steps[0].failure
    assert "\n" not in steps[0].failure
    assert steps[1].failure is None and contents(steps[1]) == ["turn 1"] and steps[1].reward == 0.5
    assert bad not in envs.running and good in envs.running
    with pytest.raises(ValueError, match=f"episode '{bad}' is not running"):
        envs.step([(bad, "again")])
    (step,) = envs.step([(good, "fine")])
    assert contents(step) == ["turn 2"]  # its state survived its neighbour's failure
    envs.end(good)


def test_a_reset_that_raises_fails_that_episode(envs):
    steps = envs.reset(["r1", "r2"], [{"prompt": "raise"}, {"prompt": "ok"}])
    assert steps[0].done and steps[0].failure.startswith("raised RuntimeError: reset failed on purpose")
    assert "Misbehaving.reset" in steps[0].failure
    assert steps[1].failure is None and steps[1].messages == [{"role": "user", "content": "go"}]
    assert "r1" not in envs.running
    envs.end("r2")


def test_misuse_is_one_line(envs):
    episode = start(envs)
    with pytest.raises(ValueError, match="already running; end\\(\\) it first"):
        envs.reset([episode], [{}])
    with pytest.raises(ValueError, match="appears twice in one call"):
        envs.step([(episode, "a"), (episode, "b")])
    with pytest.raises(ValueError, match="2 episode ids for 1 rows"):
        envs.reset(["x", "y"], [{}])
    envs.end(episode)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"workers": 0}, "env.workers=0: must be an integer >= 1"),
    ({"timeout_s": math.nan}, "env.timeout_s=nan"),
    ({"memory_limit_mb": -1}, "env.memory_limit_mb=-1"),
    ({"max_tool_calls": 0}, "env.max_tool_calls=0"),
    ({"parser": "nope"}, "env.tool_parser='nope': unknown tool parser"),
])
def test_bad_settings_are_one_line(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        EnvPool(spec("Toolbox"), **kwargs)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_bad_env_specs_are_one_line():
    for env, fragment in [(spec("Empty"), "neither reset() and step()"), (spec("Nope"), "no 'Nope' in"),
                          ("missing.py:Env", "file missing.py not found"), (spec("NoDocstring"), "no docstring")]:
        with pytest.raises(ValueError) as info:
            EnvPool(env)
        assert fragment in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------ lifecycle

def test_close_kills_every_worker_and_is_idempotent():
    pool = EnvPool(spec("GuessNumber"), workers=2, timeout_s=1)
    pids = pool.pids()
    assert len(pids) == 2 and not any(gone(pid) for pid in pids)
    pool.reset(["a"], [{"answer": 1}])
    pool.close()
    assert all(gone(pid) for pid in pids)
    assert pool.running == []
    pool.close()
    with pytest.raises(RuntimeError, match="EnvPool is closed; create a new EnvPool"):
        pool.reset(["b"], [{"answer": 1}])


def test_a_garbage_collected_pool_leaves_no_process():
    pool = EnvPool(spec("Toolbox"), workers=2, timeout_s=1)
    pids = pool.pids()
    assert not any(gone(pid) for pid in pids)
    del pool
    gc.collect()
    assert all(gone(pid) for pid in pids)
