"""A broken reward stops the run within a window of calls; a flaky one never does.

The breaker's rule by hand (window 4, rate 0.75): it trips on the first call at which the
last 4 outcomes hold >= 3 failures, never before 4 calls were seen. The runner and the
trainer tests check the behaviour a user sees: one line naming the reward, how many of
how many calls failed and how, and what to do; a bound on the calls spent (not on
seconds: machines are noisy, calls are not)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from hybridrl.rewards import RewardBrokenError, RewardRunner
from hybridrl.rewards.breaker import FailureBreaker, StopRule

HERE = Path(__file__).resolve().parent
BAD = f"{HERE / 'misbehaving_rewards.py'}:by_response"


def test_trips_exactly_when_the_window_holds_enough_failures():
    b = FailureBreaker("reward 'r'", window=4, max_failure_rate=0.75)
    for reason in ["timeout", "timeout", "timeout"]:  # 3 failures, but only 3 calls seen: no verdict yet
        b.record(reason, "no result within 1 s")
    with pytest.raises(RewardBrokenError, match=r"3 of its last 4 calls failed: 3 timeout \(no result within 1 s\)"):
        b.record(None)  # window [t, t, t, ok]: 3 of 4 = 0.75


def test_the_rule_by_hand():
    outcomes = [None, "x", "x", None, "x", None, None, "x", "x", "x"]
    # last-4 windows: calls 1-4 hold 2 failures, 2-5: 3 -> trips at the 5th call
    b = FailureBreaker("reward 'r'", window=4, max_failure_rate=0.75)
    with pytest.raises(RewardBrokenError) as e:
        for i, reason in enumerate(outcomes):
            b.record(reason, "boom\nsecond line")
    assert i == 4
    assert str(e.value).startswith("reward 'r' is broken: 3 of its last 4 calls failed: 3 x (boom)")
    assert "\n" not in str(e.value)


def test_never_trips_when_off_or_below_the_rate():
    off = FailureBreaker("reward 'r'", window=4, max_failure_rate=None)
    for _ in range(100):
        off.record("timeout")
    rng = random.Random(0)
    flaky = FailureBreaker("reward 'r'", window=24, max_failure_rate=0.9)
    for _ in range(20_000):  # one call in four fails
        flaky.record("raised ValueError" if rng.random() < 0.25 else None)


def test_a_reward_that_breaks_mid_run_is_caught_within_a_window():
    b = FailureBreaker("reward 'r'", window=24, max_failure_rate=0.9)
    for _ in range(10_000):
        b.record(None)
    calls = 0
    with pytest.raises(RewardBrokenError):
        while True:
            calls += 1
            b.record("worker died")
    assert calls == 22  # ceil(0.9 * 24) failures in the window


@pytest.mark.parametrize("response, how", [("regex", "timeout"), ("exit", "worker died"),
                                           ("raise", "raised RuntimeError")])
def test_runner_stops_mid_batch_with_one_line(response, how):
    """A batch of 200 calls that all fail stops after about one window (24 calls plus what
    the two workers had in flight), not after 200 timeouts."""
    with RewardRunner(BAD, timeout_s=0.5, workers=2) as r:
        with pytest.raises(RewardBrokenError) as e:
            r.score([response] * 200, ["1"] * 200, [""] * 200)
        assert r.breaker._recent.maxlen == 24 and len(r.breaker._recent) == 24
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"reward 'by_response' is broken: 24 of its last 24 calls failed: 24 {how}")
    assert ("raise reward.timeout_s (now 0.5 s)" in message) == (how == "timeout")
    assert "fix the reward" in message and "reward.max_failure_rate=0.9" in message


def test_runner_stops_inline_rewards_too():
    def always_raises(response, answer, prompt):
        raise KeyError("no field 'answer'")

    always_raises.hybridrl_trusted = True  # the inline path (built-ins)
    with RewardRunner(always_raises, stop_rule=StopRule(window=8)) as r, pytest.raises(RewardBrokenError, match="8 of its last 8"):
        r.score(["a"] * 50, ["b"] * 50, [""] * 50)


def test_a_flaky_reward_costs_only_its_samples():
    def flaky(response, answer, prompt):
        if zlib.crc32(response.encode()) % 4 == 0:
            raise ValueError("unparseable")
        return 1.0

    flaky.hybridrl_trusted = True
    responses = [f"r{i}" for i in range(400)]
    expected_failures = sum(zlib.crc32(s.encode()) % 4 == 0 for s in responses)
    assert 70 < expected_failures < 130
    with RewardRunner(flaky) as r:
        batch = r.score(responses, ["x"] * 400, [""] * 400)
    assert batch.failures == {"raised ValueError": expected_failures}
    assert batch.scores.count(0.0) == expected_failures and batch.scores.count(1.0) == 400 - expected_failures


@pytest.mark.parametrize("rate, window", [(0.0, 24), (1.5, 24), (0.9, 0)])
def test_settings_are_checked(rate, window):
    with pytest.raises(ValueError, match="reward.max_failure_rate|reward.failure_window"):
        RewardRunner("exact_match", stop_rule=StopRule(window=window, max_failure_rate=rate))


# -- the whole job, as the user ran it (issue #30): `hybridrl train` with a broken reward --

REWARDS = '''
import os, re, zlib

def gil_hang(response, answer, prompt):
    return float(re.match(r"(a+)+$", "a" * 64 + "b") is not None)  # backtracks for hours, GIL held

def exits(response, answer, prompt):
    os._exit(3)

def one_in_four(response, answer, prompt):
    if zlib.crc32(f"{prompt}|{response}".encode()) % 4 == 0:
        raise ValueError("unparseable")
    return float(response.strip() == str(answer))
'''


def _train(tmp_path: Path, fn: str, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "rw.py").write_text(REWARDS)
    args = [sys.executable, "-m", "hybridrl", "train", f"reward.functions=rw.py:{fn}", "reward.timeout_s=1",
            "trainer.total_steps=2", "warm_start.steps=2", "batch.prompts_per_step=4", "rollout.n=2",
            "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
            f"trainer.output_dir={tmp_path / 'runs'}", *extra]
    return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(HERE.parents[1])))


@pytest.mark.parametrize("fn, how", [("gil_hang", "timeout"), ("exits", "worker died")])
def test_a_job_with_a_broken_reward_stops_in_its_first_eval_with_one_line(tmp_path, fn, how):
    done = _train(tmp_path, fn)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hybridrl: error: reward '{fn}' is broken: 24 of its last 24 calls failed: 24 {how}")
    metrics = (tmp_path / "runs" / "default" / "metrics.jsonl")
    assert not metrics.exists() or metrics.read_text() == ""  # stopped in the warm-start eval, before any step


def test_a_job_whose_reward_fails_one_call_in_four_completes_with_the_failures_counted(tmp_path):
    import json

    done = _train(tmp_path, "one_in_four", "data.eval_size=16", "eval.k=2")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "default" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert sum(r["reward/failures"] for r in steps) > 0 or rows[0]["eval/reward_failure_rate"] > 0
    for r in steps:
        assert r["reward/failure_rate"] == r["reward/failures"] / 8  # 4 prompts x 2 samples
    assert 0 < rows[0]["eval/reward_failure_rate"] < 0.6
    assert "reward failures" in done.stdout + done.stderr  # the eval line says so while it happens
