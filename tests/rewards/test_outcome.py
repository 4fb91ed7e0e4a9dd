import math

import numpy as np
import pytest
import torch

from hybridrl.rewards.outcome import NON_NUMERIC, RewardFailure, as_number, call_batch, call_one, to_outcome


@pytest.mark.parametrize("value, expected", [
    (True, 1.0), (False, 0.0), (3, 3.0), (0.5, 0.5),
    (np.float32(0.5), 0.5), (np.float64(-2.0), -2.0), (np.int64(7), 7.0), (np.bool_(True), 1.0),
    (np.array(0.25), 0.25), (torch.tensor(0.75), 0.75), (torch.tensor(True), 1.0),
    (torch.tensor(2.0, requires_grad=True), 2.0),
])
def test_numbers_of_every_kind_count(value, expected):
    assert as_number(value) == expected


@pytest.mark.parametrize("value", [None, "1", 1j, float("nan"), float("inf"), np.float32("nan"),
                                   np.array([1.0]), torch.tensor([1.0]), [1.0]])
def test_non_numbers_are_rejected(value):
    assert as_number(value) is None
    assert to_outcome(value).failure == NON_NUMERIC


def test_dict_results_carry_extras():
    out = to_outcome({"score": np.float32(1.0), "length": 12, "ok": True})
    assert out.score == 1.0 and out.extras == {"length": 12.0, "ok": 1.0} and out.failure is None
    assert to_outcome({"length": 3}).failure == "dict result without a 'score' key"
    assert to_outcome({"score": 1.0, "note": "x"}).failure == "non-numeric or non-finite extra 'note'"
    assert to_outcome({"score": math.nan}).failure == NON_NUMERIC


def test_call_one_catches_system_exit_and_reward_failure():
    def exits(*_):
        raise SystemExit(1)

    def refuses(*_):
        raise RewardFailure("no answer tag")

    assert call_one(exits, "", None, "").failure == "raised SystemExit"
    assert call_one(refuses, "", None, "").failure == "no answer tag"


def test_call_batch_checks_length_and_fails_slots():
    def fn(responses, answers, prompts):
        return [1.0, RewardFailure("slot"), "x"]

    outs = call_batch(fn, ["a", "b", "c"], [None] * 3, [""] * 3)
    assert [o.score for o in outs] == [1.0, None, None]
    assert [o.failure for o in outs] == [None, "slot", NON_NUMERIC]
    short = call_batch(lambda *a: [1.0], ["a", "b"], [None] * 2, [""] * 2)
    assert [o.failure for o in short] == ["batched reward returned 1 results for 2 samples"] * 2


def test_failure_detail_names_the_message_and_where():
    def bad(response, answer, prompt):
        raise KeyError("missing field")

    out = call_one(bad, "", None, "")
    assert out.failure == "raised KeyError"
    assert out.detail.startswith("KeyError: 'missing field' (") and "test_outcome.py:" in out.detail
    assert call_one(lambda r, a, p: "1", "", None, "").detail == "returned str '1'"
    assert call_one(lambda r, a, p: bytearray(1 << 62), "", None, "").failure == "memory limit"


def test_values_whose_inspection_raises_fail_the_sample_only():
    class Weird:
        ndim = 0

        def item(self):
            raise RuntimeError("no item")

    def exploding():
        yield 1.0
        raise ValueError("half way")

    assert call_one(lambda r, a, p: Weird(), "", None, "").failure == "raised RuntimeError"
    assert [o.failure for o in call_batch(lambda rs, a, p: exploding(), ["a", "b"], [None] * 2, ["", ""])] == \
        ["raised ValueError"] * 2
