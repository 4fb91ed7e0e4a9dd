"""build_reward: the config shapes of ``reward.functions``."""

from pathlib import Path

import pytest

from hybridrl.rewards import CombinedReward, RewardRunner, build_reward, get_reward_fn

HERE = Path(__file__).resolve().parent
SPEC = [{"name": "gsm8k", "weight": 1.0}, {"name": "format", "weight": 0.1, "pattern": r"^<think>.*</think>"}]


def test_names_and_paths():
    assert build_reward("gsm8k") is get_reward_fn("gsm8k")
    assert build_reward(f"{HERE / 'misbehaving_rewards.py'}:by_response")("a", "a", "") == 1.0
    assert build_reward([{"name": "gsm8k"}]) is get_reward_fn("gsm8k")  # one entry, weight 1: no wrapper


def test_weighted_list():
    combo = build_reward(SPEC)
    assert isinstance(combo, CombinedReward)
    assert [(label, w) for label, _, w in combo.parts] == [("gsm8k", 1.0), ("format", 0.1)]
    assert combo("<think>24+48</think> #### 72", "#### 72", "") == {"score": 1.1, "gsm8k": 1.0, "format": 1.0}
    assert combo("#### 72", "#### 72", "")["score"] == 1.0


def test_labels_and_user_paths():
    spec = [{"name": f"{HERE / 'misbehaving_rewards.py'}:by_response", "weight": 2},
            {"name": "format", "label": "think", "pattern": "<think>"}]
    combo = build_reward(spec)
    assert [label for label, _, _ in combo.parts] == ["by_response", "think"]
    assert combo("<think>", "<think>", "") == {"score": 3.0, "by_response": 1.0, "think": 1.0}


def test_runner_takes_the_spec():
    with RewardRunner(SPEC, workers=1) as r:
        batch = r.score(["<think>x</think>\n#### 72", "#### 71"], ["#### 72", "#### 72"], ["", ""])
    assert batch.scores == [1.1, 0.0] and batch.extras == {"gsm8k": [1.0, 0.0], "format": [1.0, 0.0]}


@pytest.mark.parametrize("spec, message", [
    ("gsm8kk", r"reward.functions='gsm8kk' is unknown; did you mean 'gsm8k'\?"),
    ([{"name": "math_verfy"}], r"reward.functions\[0\].name='math_verfy' is unknown; did you mean 'math_verify'\?"),
    ([{"name": "gsm8k"}, {"weight": 1.0}], r"reward.functions\[1\]: missing 'name'"),
    ([{"name": "gsm8k", "weight": float("nan")}], r"reward.functions\[0\].weight=nan: must be a finite number"),
    ([{"name": "gsm8k", "weight": "1"}], r"reward.functions\[0\].weight='1': must be a finite number"),
    ([{"name": "gsm8k", "pattern": "x"}], r"reward.functions\[0\].name='gsm8k' takes no options; remove pattern"),
    ([{"name": "format", "patern": "x"}], r"unknown option\(s\) patern; it accepts pattern"),
    ([{"name": "format", "pattern": "("}], r"not a valid regex"),
    (["gsm8k"], r"reward.functions\[0\]='gsm8k': each entry must be a mapping"),
    ([], r"give a reward name, a path/to/file.py:fn, or a non-empty list"),
    (3, r"give a reward name"),
    ([{"name": "gsm8k", "label": ""}], r"reward.functions\[0\].label='': must be a non-empty string"),
])
def test_errors_are_one_line_and_say_where(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        build_reward(spec)
    assert "\n" not in str(e.value)
