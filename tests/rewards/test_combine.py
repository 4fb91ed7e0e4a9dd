"""The format reward and weighted combinations, on rows written here."""

import math
from pathlib import Path

import pytest

from hybridrl.rewards import CombinedReward, RewardRunner, combine, format_reward, get_reward_fn
from hybridrl.rewards.regex_format import R1_PATTERN
from hybridrl.rewards.registry import is_batched, is_trusted

HERE = Path(__file__).resolve().parent

R1_OK = "<think>48 / 2 = 24, 48 + 24 = 72</think>\n<answer>#### 72</answer>"
R1_NO_THINK = "<answer>#### 72</answer>"
R1_WRONG = "<think>hmm</think><answer>#### 70</answer>"
GSM_ROW = "48/2 = <<48/2=24>>24\n48+24 = <<48+24=72>>72\n#### 72"


def test_format_default_is_the_r1_layout():
    fmt = get_reward_fn("format")
    assert fmt.pattern == R1_PATTERN
    assert [fmt(r, None, "") for r in (R1_OK, R1_NO_THINK, R1_WRONG, R1_OK + " trailing")] == [1.0, 0.0, 1.0, 0.0]


def test_format_pattern_and_errors():
    boxed = format_reward(r"\\boxed\{.+\}")
    assert boxed("so $\\boxed{3}$", None, "") == 1.0 and boxed("so 3", None, "") == 0.0
    with pytest.raises(ValueError, match="not a valid regex") as e:
        format_reward("(unclosed")
    assert "\n" not in str(e.value)


def test_combined_scores_and_components():
    combo = combine([("gsm8k", 1.0), ("format", 0.5)])
    assert isinstance(combo, CombinedReward) and not is_trusted(combo) and not is_batched(combo)
    # hand-derived: 1*gsm8k + 0.5*format
    assert combo(R1_OK, GSM_ROW, "") == {"score": 1.5, "gsm8k": 1.0, "format": 1.0}
    assert combo(R1_NO_THINK, GSM_ROW, "") == {"score": 1.0, "gsm8k": 1.0, "format": 0.0}
    assert combo(R1_WRONG, GSM_ROW, "") == {"score": 0.5, "gsm8k": 0.0, "format": 1.0}
    assert combo("72", GSM_ROW, "") == {"score": 0.0, "gsm8k": 0.0, "format": 0.0}


def test_combined_in_the_runner_reports_components_as_extras():
    combo = combine([("gsm8k", 1.0), (format_reward(r"^<think>"), 0.25), ("format", 0.5)])
    responses = [R1_OK, R1_NO_THINK, R1_WRONG]
    with RewardRunner(combo, workers=2) as r:
        batch = r.score(responses, [GSM_ROW] * 3, [""] * 3)
    assert batch.scores == [1.75, 1.0, 0.75]
    # a second format reward keeps its own metric under a suffixed label
    assert batch.extras == {"gsm8k": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0], "format_2": [1.0, 0.0, 1.0]}
    assert batch.extra_means()["gsm8k"] == pytest.approx(2 / 3)


def test_all_trusted_combination_runs_inline():
    runner = RewardRunner(combine([("gsm8k", 1.0), ("exact_match", 2.0)]))
    assert runner._pool is None
    assert runner.score(["#### 72"], ["#### 72"], [""]).scores == [3.0]  # both match


def test_a_failing_component_fails_the_sample_naming_it():
    bad = get_reward_fn(f"{HERE / 'misbehaving_rewards.py'}:by_response")  # exact match unless told
    with RewardRunner(combine([("gsm8k", 1.0), (bad, 1.0)]), timeout_s=5.0, workers=1) as r:  # ms calls vs 5 s
        batch = r.score(["#### 72", "raise", "hang"], ["#### 72"] * 3, [""] * 3)
    assert batch.scores == [2.0, 0.0, 0.0]
    assert batch.failures == {"by_response: raised RuntimeError": 1, "timeout": 1}
    assert batch.extras["gsm8k"][0] == 1.0 and all(math.isnan(v) for v in batch.extras["gsm8k"][1:])


def test_batched_components_make_a_batched_combination():
    lengths = get_reward_fn(f"{HERE / 'misbehaving_rewards.py'}:batched_length")
    by_first = get_reward_fn(f"{HERE / 'misbehaving_rewards.py'}:batched_by_first")
    combo = combine([("gsm8k", 1.0), (lengths, 0.1), (by_first, 2.0)])
    assert is_batched(combo)
    with RewardRunner(combo, workers=1) as r:
        batch = r.score(["#### 72", "ab"], ["#### 72", "#### 72"], ["", ""])
    # row 0: 1 + 0.1 * 7 + 2 * 1; row 1: batched_by_first fails that slot only
    assert batch.scores == [pytest.approx(3.7), 0.0]
    assert batch.failures == {"batched_by_first: mismatch": 1}
    assert batch.extras["batched_length"][0] == 7.0


def test_combine_checks_weights_and_names():
    with pytest.raises(ValueError, match=r"combine\(\)\[1\].weight=nan: must be a finite number"):
        combine([("gsm8k", 1.0), ("format", float("nan"))])
    with pytest.raises(ValueError, match="did you mean 'format'"):
        combine([("formta", 1.0)])
    with pytest.raises(ValueError, match="at least one"):
        combine([])
