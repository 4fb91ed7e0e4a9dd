import time

import pytest

from hybridrl.rewards import RewardRunner, get_reward_fn


def test_builtin_exact_match_and_last_number():
    em = get_reward_fn("exact_match")
    assert em("82", "82", "37+45=") == 1.0 and em(" 82 ", 82, "") == 1.0 and em("8", "82", "") == 0.0
    ln = get_reward_fn("last_number")
    assert ln("so it is 12 then 42", "42", "") == 1.0 and ln("none", "42", "") == 0.0


def test_unknown_name_suggests():
    with pytest.raises(ValueError, match="did you mean 'exact_match'"):
        get_reward_fn("exact_mach")


def test_user_function_from_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def score(response, answer, prompt):\n    return float(len(response))\n")
    fn = get_reward_fn(f"{f}:score")
    assert fn("abc", None, "") == 3.0
    with pytest.raises(ValueError, match="no callable"):
        get_reward_fn(f"{f}:nope")


def _flaky(response, answer, prompt):
    if response == "raise":
        raise RuntimeError("boom")
    if response == "hang":
        time.sleep(5)
        return 1.0
    if response == "str":
        return "yes"
    if response == "nan":
        return float("nan")
    if response == "inf":
        return float("inf")
    if response == "slow":
        time.sleep(0.3)
        return 1.0
    return 1.0 if response == answer else 0.0


def test_failures_cost_only_their_sample():
    runner = RewardRunner(_flaky, timeout_s=0.5, workers=4)
    responses = ["1", "raise", "hang", "str", "nan", "2"]
    answers = ["1", "1", "1", "1", "1", "3"]
    t0 = time.perf_counter()
    batch = runner.score(responses, answers, [""] * 6)
    assert time.perf_counter() - t0 < 4  # the hung call was abandoned, not awaited
    assert batch.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert batch.failures["timeout"] == 1 and batch.failures["raised RuntimeError"] == 1
    assert batch.failures["non-numeric or non-finite result"] == 2
    # the runner is usable afterwards
    assert runner.score(["5", "inf"], ["5", "1"], ["", ""]).scores == [1.0, 0.0]
    runner.close()


def test_timeout_is_per_call_not_per_batch():
    # 16 calls of 0.3 s on 4 workers take ~1.2 s in all, each well under its 1 s limit
    runner = RewardRunner(_flaky, timeout_s=1.0, workers=4)
    batch = runner.score(["slow"] * 16, ["1"] * 16, [""] * 16)
    assert batch.scores == [1.0] * 16 and not batch.failures


def test_hung_reward_does_not_block_exit(tmp_path):
    import subprocess
    import sys

    code = ("import time\nfrom hybridrl.rewards import RewardRunner\n"
            "r = RewardRunner(lambda *a: time.sleep(60), timeout_s=0.2)\n"
            "print(r.score(['x'], [None], ['']).failures['timeout'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "1"
