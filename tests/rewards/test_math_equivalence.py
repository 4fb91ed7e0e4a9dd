"""math_verify reward on MATH-style rows written here (answers as in MATH's answer
column, or a full solution with its boxed answer), against hand-derived equivalences."""

import pytest

import hybridrl.rewards.math_equivalence as math_equivalence
from hybridrl.rewards import RewardRunner, get_reward_fn

pytest.importorskip("math_verify")

ROWS = [  # (problem, reference answer)
    ("What is $\\frac{3}{6}$ in lowest terms?", "\\frac{1}{2}"),
    ("Expand $(x+1)^2$.", "x^2+2x+1"),
    ("Rationalize $\\frac{1}{\\sqrt{2}}$.", "\\frac{\\sqrt{2}}{2}"),
    ("Solve $x^2 = 9$ for $x > 0$.", "Since $x>0$, $x = \\boxed{3}$."),  # a full solution as reference
    ("For which $x$ is $2 < x \\le 3$? Give an interval.", "(2,3]"),
]


@pytest.mark.parametrize("row, response, expected", [
    (0, "Dividing by 3, the answer is $\\boxed{\\frac{1}{2}}$.", 1.0),
    (0, "$\\boxed{0.5}$", 1.0),
    (0, "$\\boxed{\\frac{2}{4}}$", 1.0),
    (0, "$\\boxed{\\frac{1}{3}}$", 0.0),
    (0, "I am not sure.", 0.0),
    (1, "$\\boxed{(x+1)^2}$", 1.0),  # equal as expressions, not as strings
    (1, "$\\boxed{x^2+x+1}$", 0.0),
    (2, "$\\boxed{\\frac{1}{\\sqrt{2}}}$", 1.0),
    (3, "So $x = \\boxed{3}$.", 1.0),
    (3, "$\\boxed{-3}$", 0.0),
    (4, "$\\boxed{(2, 3]}$", 1.0),
    (4, "$\\boxed{[2, 3]}$", 0.0),  # a closed interval is a different set
])
def test_math_rows(row, response, expected):
    assert get_reward_fn("math_verify")(response, ROWS[row][1], ROWS[row][0]) == expected


def test_math_verify_runs_in_workers():
    responses = ["$\\boxed{0.5}$", "$\\boxed{(x+1)^2}$", "$\\boxed{1}$", "So $x = \\boxed{3}$.", "none"]
    with RewardRunner("math_verify", workers=2, timeout_s=60) as r:
        assert r._pool is not None  # sympy may run for ever: it must be killable
        batch = r.score(responses, [row[1] for row in ROWS], [row[0] for row in ROWS])
    assert batch.scores == [1.0, 1.0, 0.0, 1.0, 0.0] and not batch.failures


def test_unparseable_or_missing_reference_is_a_failure_not_a_zero():
    with RewardRunner("math_verify", workers=1, timeout_s=60) as r:
        batch = r.score(["$\\boxed{1}$", "$\\boxed{1}$"], [None, "$$"], ["", ""])
    assert batch.failures == {"math_verify: no ground-truth answer": 1,
                              "math_verify: could not parse the ground-truth answer": 1}


def test_missing_package_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setattr(math_equivalence, "FORCE_MISSING", True)
    with pytest.raises(ImportError, match=r"pip install 'hybridrl\[math\]'") as e:
        get_reward_fn("math_verify")("$\\boxed{1}$", "1", "")
    assert "\n" not in str(e.value)


def test_missing_package_in_workers_fails_the_runner_up_front(tmp_path, monkeypatch):
    # workers import from the trainer's sys.path: shadow math_verify there with a package
    # that cannot be imported, as in an environment without the extra
    fake = tmp_path / "math_verify"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named math_verify')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"could not load the reward: ImportError: .*pip install 'hybridrl\[math\]'"):
        RewardRunner("math_verify", workers=1)
