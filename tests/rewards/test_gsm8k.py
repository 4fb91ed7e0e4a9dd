"""gsm8k reward on GSM8K-style rows written here (ground truths in the dataset's
``... #### N`` solution format), against hand-derived scores."""

from fractions import Fraction

import pytest

from hybridrl.rewards import RewardRunner, get_reward_fn
from hybridrl.rewards.gsm8k import extract_answer, ground_truth, parse_number

ROWS = [  # (question, GSM8K solution)
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
     "How many clips did Natalia sell altogether in April and May?",
     "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
     "altogether in April and May.\n#### 72"),
    ("A shop earned $1,000 on Monday and $234 on Tuesday. How much did it earn in total?",
     "1000 + 234 = <<1000+234=1234>>1234\n#### 1,234"),
    ("The temperature was 3 degrees and fell by 8 degrees. What is it now?",
     "3 - 8 = <<3-8=-5>>-5\n#### -5"),
]


@pytest.mark.parametrize("row, response, expected", [
    (0, "She sold 24 in May, so 48 + 24 = 72.\n#### 72", 1.0),
    (0, "In May: 24. Total: 72. The answer is 72.", 1.0),
    (0, "so the total is $\\boxed{72}$", 1.0),
    (0, "#### 72 clips", 1.0),
    (0, "#### 72.00", 1.0),  # numeric, not string, comparison
    (0, "#### 71", 0.0),
    (0, "48 + 24 = 72", 0.0),  # no final-answer marker: not credited
    (0, "#### 72\nWait, let me redo it.\n#### 70", 0.0),  # the last marker counts
    (0, "####", 0.0),
    (1, "#### 1234", 1.0),  # "1,234" == "1234"
    (1, "The answer is $1,234.", 1.0),
    (1, "The answer is: **1,234**", 1.0),
    (1, "#### 1,243", 0.0),
    (2, "#### −5", 1.0),  # Unicode minus
    (2, "The answer is -5 degrees.", 1.0),
    (2, "#### 5", 0.0),  # the sign matters
])
def test_gsm8k_rows(row, response, expected):
    assert get_reward_fn("gsm8k")(response, ROWS[row][1], ROWS[row][0]) == expected


@pytest.mark.parametrize("text, value", [
    ("1,234", 1234), ("$1,234.50", Fraction(2469, 2)), ("−5", -5), ("-$5", -5), ("$-5", -5), ("\\$7", 7),
    ("3/4", Fraction(3, 4)), ("5.00", 5), ("+8", 8), ("007", 7), ("costs 12 dollars, 3 cents", 12),
    ("no digits", None), ("", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_ground_truth_and_extraction():
    assert ground_truth(ROWS[0][1]) == 72 and ground_truth(" 42 ") == 42 and ground_truth(42) == 42
    assert ground_truth(None) is None and ground_truth("#### none") is None
    assert extract_answer("no marker here 5") is None


def test_gsm8k_never_credits_a_missing_ground_truth():
    fn = get_reward_fn("gsm8k")
    assert fn("#### 5", None, "") == 0.0 and fn("#### 5", "#### n/a", "") == 0.0


def test_adversarial_text_is_linear_time():
    # trusted rewards run inline without a timeout, so their regexes must not backtrack
    fn = get_reward_fn("gsm8k")
    for text in [" " * 200_000, "$" * 200_000, "####" + " $" * 100_000, "answer is " * 20_000, "9," * 100_000]:
        assert fn(text, "1", "") == 0.0


def test_gsm8k_runs_inline_in_the_runner():
    runner = RewardRunner("gsm8k")
    assert runner._pool is None
    batch = runner.score(["#### 72", "The answer is 1234", "#### 5"], [r[1] for r in ROWS], [r[0] for r in ROWS])
    assert batch.scores == [1.0, 1.0, 0.0] and not batch.failures
