"""RewardRunner: each reviewed failure of the thread-based runner, reproduced.

Misbehaving rewards come from misbehaving_rewards.py by path, the way a user's
``reward.functions: path/to/file.py:fn`` reaches the worker processes.

No assert depends on speed. A hung call here cannot end by itself (it sleeps ten minutes,
backtracks for hours, or waits for a file the test never creates: gated_rewards.py), so a
score that returns with it counted as a timeout, and the worker that ran it dead, shows that
the runner killed it rather than waited. The calls that must not time out take milliseconds
against a timeout of seconds (``TIMEOUT_S``)."""

import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hybridrl.rewards import RewardRunner, get_reward_fn
from misbehaving_rewards import _pid_alive

HERE = Path(__file__).resolve().parent
BAD = f"{HERE / 'misbehaving_rewards.py'}:by_response"
TYPED = f"{HERE / 'misbehaving_rewards.py'}:typed"
GATED = f"{HERE / 'gated_rewards.py'}:gated"
TIMEOUT_S = 5.0  # what a hung call costs; the calls that must finish take milliseconds


def _killed(before: list[int], after: list[int]) -> set[int]:
    """The workers of ``before`` that were replaced, each checked dead (killed and reaped)."""
    gone = set(before) - set(after)
    assert not [pid for pid in gone if _pid_alive(pid)], f"replaced workers still running: {gone}"
    return gone


@pytest.fixture(scope="module")
def runner():
    r = RewardRunner(BAD, timeout_s=TIMEOUT_S, workers=2)
    yield r
    r.close()


def test_failures_cost_only_their_sample(runner):
    responses = ["1", "raise", "hang", "2", "regex", "exit", "sys.exit", "3"]
    answers = ["1", "1", "1", "2", "1", "1", "1", "x"]
    before = runner._pool.pids()
    batch = runner.score(responses, answers, [""] * 8)
    assert batch.scores == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert batch.failures == {"raised RuntimeError": 1, "timeout": 2, "worker died": 1, "raised SystemExit": 1}
    assert _killed(before, runner._pool.pids())  # "hang" and "regex" could not end by themselves
    assert runner.score(["5", "6"], ["5", "1"], ["", ""]).scores == [1.0, 0.0]  # still usable


def test_gil_holding_reward_is_killed_at_its_timeout(runner):
    # a thread could never stop this match: it holds the GIL inside re for hours
    before = runner._pool.pids()
    batch = runner.score(["regex", "ok"], ["1", "ok"], ["", ""])
    assert batch.scores == [0.0, 1.0] and batch.failures == {"timeout": 1}
    assert len(_killed(before, runner._pool.pids())) == 1


def test_dying_worker_costs_its_sample_and_is_replaced(runner):
    pids = set(runner._pool.pids())
    batch = runner.score(["a", "exit", "b", "segfault", "c"], ["a", "x", "b", "x", "c"], [""] * 5)
    assert batch.scores == [1.0, 0.0, 1.0, 0.0, 1.0] and batch.failures == {"worker died": 2}
    assert len(runner._pool.pids()) == 2 and set(runner._pool.pids()) != pids


def test_sys_exit_is_an_ordinary_failure_not_a_timeout():
    # the thread runner lost the result and waited out the full timeout for each call (so
    # they counted as timeouts); here each is its own failure and the workers stay
    with RewardRunner(BAD, timeout_s=120.0, workers=2) as r:
        before = r._pool.pids()
        batch = r.score(["sys.exit"] * 4 + ["ok"], ["x"] * 4 + ["ok"], [""] * 5)
        assert r._pool.pids() == before
    assert batch.scores == [0.0] * 4 + [1.0] and batch.failures == {"raised SystemExit": 4}


def _until(condition, score) -> None:
    """Wait until ``condition()``; a score call that ends first fails the test with its outcome."""
    while not condition():
        if score.done():
            pytest.fail(f"the score call ended before the test released it: {score.result()}")
        time.sleep(0.005)


def test_timed_out_call_while_another_still_runs(tmp_path):
    # The thread runner crashed with KeyError when a timed-out call finished while another
    # was still running. Three gated calls (gated_rewards.py), ordered by files: a never
    # finishes (killed at its timeout); b, on the other worker, finishes meanwhile; c starts
    # there after b, is still running when a is killed, and returns after that.
    # a and c each have TIMEOUT_S from their own start, so c must start well after a: b is
    # released half a timeout after a started (the one margin of time, TIMEOUT_S / 2 each way).
    calls = [f"gate {tmp_path} {name}" for name in "abc"]
    started = lambda name: (tmp_path / f"{name}.pid").exists()  # noqa: E731
    pid = lambda name: int((tmp_path / f"{name}.pid").read_text())  # noqa: E731
    with RewardRunner(GATED, timeout_s=TIMEOUT_S, workers=2) as r, ThreadPoolExecutor(1) as pool:
        score = pool.submit(r.score, calls, ["x"] * 3, [""] * 3)
        _until(lambda: started("a") and started("b"), score)
        time.sleep(TIMEOUT_S / 2)
        (tmp_path / "b.go").touch()
        _until(lambda: started("c"), score)
        _until(lambda: not _pid_alive(pid("a")), score)  # a's worker killed at a's timeout, c still running
        (tmp_path / "c.go").touch()
        batch = score.result()
    assert pid("c") == pid("b") != pid("a")
    assert batch.scores == [0.0, 1.0, 1.0] and batch.failures == {"timeout": 1}


def test_return_types_are_numbers():
    # bool, numpy scalars and 0-d arrays used to score 0 for every sample
    with RewardRunner(TYPED, workers=1) as r:
        ok = ["bool", "false", "np.float32", "np.int64", "np.bool_", "ndarray0d"]
        assert r.score(ok, [None] * 6, [""] * 6).scores == [1.0, 0.0, 0.5, 2.0, 1.0, 0.25]
        bad = ["ndarray1d", "str", "none", "nan", "inf", "complex"]
        batch = r.score(bad, [None] * 6, [""] * 6)
    assert batch.scores == [0.0] * 6 and batch.failures == {"non-numeric or non-finite result": 6}


def test_zero_dim_tensor_from_a_worker():
    with RewardRunner(f"{HERE / 'misbehaving_rewards.py'}:tensor_score", workers=1, timeout_s=60) as r:
        assert r.score(["a", "b"], [None] * 2, [""] * 2).scores == [0.75, 0.75]


def test_dict_results_become_extras():
    with RewardRunner(TYPED, workers=1) as r:
        batch = r.score(["dict", "str", "dict", "dict-no-score", "dict-bad-extra"], [None] * 5, [""] * 5)
    assert batch.scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert batch.extras["length"][0] == 3.0 and batch.extras["length"][2] == 3.0
    assert all(math.isnan(v) for i, v in enumerate(batch.extras["length"]) if i not in (0, 2))
    assert batch.extra_means() == {"length": 3.0, "ok": 1.0}
    assert batch.failures == {"non-numeric or non-finite result": 1, "dict result without a 'score' key": 1,
                              "non-numeric or non-finite extra 'note'": 1}


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), 0, -1.0, "10", True])
def test_timeout_must_be_finite_and_positive(timeout_s):
    with pytest.raises(ValueError, match=r"timeout_s=.*must be a finite number of seconds > 0") as e:
        RewardRunner("exact_match", timeout_s=timeout_s)
    assert "\n" not in str(e.value)


def test_failure_reward_and_totals():
    with RewardRunner(BAD, timeout_s=5.0, workers=1, failure_reward=-1.0) as r:
        assert r.score(["raise", "a"], ["a", "a"], ["", ""]).scores == [-1.0, 1.0]
        r.score(["raise"], ["a"], [""])
        assert r.total_failures == {"raised RuntimeError": 2}


def test_batched_reward_is_called_once_per_batch():
    spec = f"{HERE / 'misbehaving_rewards.py'}:batched_length"
    with RewardRunner(spec, workers=1) as r:
        assert r.score(["a", "bbb", ""], [None] * 3, [""] * 3).scores == [1.0, 3.0, 0.0]


def test_batched_failures_cost_the_batch_counted_per_sample():
    spec = f"{HERE / 'misbehaving_rewards.py'}:batched_by_first"
    with RewardRunner(spec, timeout_s=TIMEOUT_S, workers=1) as r:
        ok = r.score(["a", "b", "c"], ["a", "x", "c"], [""] * 3)
        assert ok.scores == [1.0, 0.0, 1.0] and ok.failures == {"mismatch": 1}
        assert r.score(["raise", "a"], ["a", "a"], ["", ""]).failures == {"raised ValueError": 2}
        assert r.score(["short", "a", "b"], ["a"] * 3, [""] * 3).failures == {
            "batched reward returned 1 results for 3 samples": 3}
        before = r._pool.pids()
        hung = r.score(["hang", "a", "b"], ["a"] * 3, [""] * 3)
        assert hung.scores == [0.0] * 3 and hung.failures == {"timeout": 3}
        assert len(_killed(before, r._pool.pids())) == 1
        assert r.score(["a"], ["a"], [""]).scores == [1.0]  # a fresh worker took over


def test_trusted_builtin_runs_inline_with_identical_scores():
    runner = RewardRunner("exact_match", timeout_s=10.0)
    assert runner._pool is None  # no process hop for the default reward
    responses, answers = ["82", " 82 ", "8", "", "x"], ["82", 82, "82", None, "x"]
    em = get_reward_fn("exact_match")
    assert runner.score(responses, answers, [""] * 5).scores == [em(r, a, "") for r, a in zip(responses, answers)]
    assert runner.score(responses, answers, [""] * 5).scores == [1.0, 1.0, 0.0, 0.0, 1.0]
    runner.close()


def test_function_objects_travel_by_reference_or_spec():
    fn = get_reward_fn(BAD)  # loaded from a file: the worker loads it again by its spec
    with RewardRunner(fn, workers=1) as r:
        assert r.score(["a", "raise"], ["a", "a"], ["", ""]).scores == [1.0, 0.0]
    with RewardRunner(_module_level_reward, workers=1) as r:  # importable: pickled by reference
        assert r.score(["abc"], [None], [""]).scores == [3.0]


def _module_level_reward(response, answer, prompt):
    return float(len(response))


def test_lambdas_are_refused_with_a_hint():
    with pytest.raises(ValueError, match=r"cannot be sent to a worker process .*path/to/file.py:fn") as e:
        RewardRunner(lambda r, a, p: 1.0)
    assert "\n" not in str(e.value)


def test_worker_that_cannot_load_the_reward_fails_at_construction(tmp_path):
    f = tmp_path / "needs_cwd.py"
    f.write_text("import os\nif os.environ.get('HYBRIDRL_TEST_IN_PARENT') != '1':\n"
                 "    raise ImportError('only importable in the parent')\n"
                 "def score(response, answer, prompt):\n    return 1.0\n")
    import os

    os.environ["HYBRIDRL_TEST_IN_PARENT"] = "1"
    try:
        fn = get_reward_fn(f"{f}:score")
    finally:
        del os.environ["HYBRIDRL_TEST_IN_PARENT"]
    with pytest.raises(ValueError, match="could not load the reward: .*ImportError: only importable in the parent"):
        RewardRunner(fn, workers=2)


def test_score_checks_lengths():
    with pytest.raises(ValueError, match="2 responses, 1 answers and 2 prompts"):
        RewardRunner("exact_match").score(["a", "b"], ["a"], ["", ""])
    assert RewardRunner("exact_match").score([], [], []).scores == []


def test_first_error_of_each_reason_is_reported_once_with_its_message():
    reports = []
    with RewardRunner(BAD, timeout_s=TIMEOUT_S, workers=2, report=reports.append) as r:
        r.score(["raise", "raise", "exit", "hang", "1"], ["1"] * 5, [""] * 5)
        r.score(["raise", "exit"], ["1", "1"], ["", ""])
        first = dict(r.first_errors)
    assert set(first) == {"raised RuntimeError", "worker died", "timeout"}
    assert first["raised RuntimeError"].startswith("RuntimeError: boom (")
    assert "misbehaving_rewards.py:" in first["raised RuntimeError"]  # where it was raised
    assert "exited with code 3" in first["worker died"]
    assert f"no result within {TIMEOUT_S:g} s" in first["timeout"]
    assert len(reports) == 3 and all("\n" not in line for line in reports)
    assert any("(raised RuntimeError): RuntimeError: boom (" in line for line in reports)


def test_first_errors_go_to_logging_by_default(caplog):
    with RewardRunner(BAD, workers=1) as r, caplog.at_level("WARNING", logger="hybridrl.rewards.runner"):
        r.score(["raise", "raise"], ["1", "1"], ["", ""])
    warnings = [rec.getMessage() for rec in caplog.records]
    assert len(warnings) == 1 and "RuntimeError: boom" in warnings[0]


def test_first_error_of_a_component_names_it():
    reports = []
    spec = [{"name": "exact_match", "weight": 1.0}, {"name": f"{HERE / 'misbehaving_rewards.py'}:by_response",
                                                     "weight": 0.5, "label": "bad"}]
    with RewardRunner(spec, workers=1, report=reports.append) as r:
        assert r.score(["raise"], ["x"], [""]).failures == {"bad: raised RuntimeError": 1}
    assert r.first_errors["bad: raised RuntimeError"].startswith("bad: RuntimeError: boom (")


def test_memory_limit_fails_the_sample_and_keeps_the_worker():
    with RewardRunner(BAD, workers=1, memory_limit_mb=512) as r:
        pids = r._pool.pids()
        batch = r.score(["alloc", "ok"], ["x", "ok"], ["", ""])
        assert batch.scores == [0.0, 1.0] and batch.failures == {"memory limit": 1}
        assert r._pool.pids() == pids  # a MemoryError is an ordinary failure, not a dead worker
        assert r.first_errors["memory limit"].startswith("MemoryError")


@pytest.mark.parametrize("limit", [0, -5, 1.5, True, "512"])
def test_memory_limit_must_be_a_positive_integer(limit):
    with pytest.raises(ValueError, match="reward.memory_limit_mb"):
        RewardRunner(BAD, memory_limit_mb=limit)


def test_worker_output_goes_to_devnull_or_a_file(tmp_path, capfd):
    with RewardRunner(BAD, workers=1) as r:
        assert r.score(["print"], ["x"], [""]).scores == [1.0]
    out, err = capfd.readouterr()
    assert "reward-debug" not in out + err
    log_file = tmp_path / "reward_workers.log"
    with RewardRunner(BAD, workers=1, worker_output=log_file) as r:
        r.score(["print"], ["x"], [""])
    text = log_file.read_text()
    assert text.count("reward-debug-output") == 100 and text.count("reward-debug-stderr") == 100


def test_two_threads_scoring_at_once_get_their_own_scores():
    """An async run's reward thread and the evaluation on the main thread score through one
    runner at the same time (the pool is not thread-safe: two at once raised ``<_Worker> is not
    in list`` or hung); every call gets its own batch's scores."""
    r = RewardRunner(BAD, timeout_s=TIMEOUT_S, workers=2)
    try:
        def score(thread: int):
            got = []
            for call in range(15):
                answers = [str((thread + call + i) % 3) for i in range(6)]
                responses = [str(i % 3) for i in range(6)]
                want = [float(a == b) for a, b in zip(responses, answers)]
                got.append((r.score(responses, answers, [""] * 6).scores, want))
            return got

        with ThreadPoolExecutor(2) as pool:
            for results in pool.map(score, range(2)):
                for scores, want in results:
                    assert scores == want
    finally:
        r.close()
