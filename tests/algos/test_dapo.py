import pytest
import torch

from hybridrl.algos import dynamic_sampling_keep, mask_truncated_responses, overlong_reward_penalty


def test_overlong_penalty_hand():
    # L_max = 20, buffer 4 → free up to 16, linear to -f at 20, -f beyond
    pen = overlong_reward_penalty([10, 16, 17, 18, 20, 25], max_response_length=20, overlong_buffer_len=4,
                                  overlong_penalty_factor=0.5)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]))
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_reward_penalty([1], max_response_length=20, overlong_buffer_len=0)


def test_mask_truncated():
    mask = torch.ones(3, 4)
    out, trunc = mask_truncated_responses(mask, finish_reasons=["stop", "length", "stop"])
    assert trunc.tolist() == [False, True, False]
    assert out.sum(-1).tolist() == [4.0, 0.0, 4.0]
    out2, trunc2 = mask_truncated_responses(mask, response_lengths=[3, 8, 7], max_response_length=8)
    assert trunc2.tolist() == [False, True, False] and torch.equal(out, out2)
    with pytest.raises(ValueError, match="finish_reasons"):
        mask_truncated_responses(mask)


def test_dynamic_sampling_keep():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.5])
    index = ["a", "a", "a", "b", "b", "c", "c", "c", "d"]  # a all-1 (drop), b mixed, c all-0 (drop), d single
    assert dynamic_sampling_keep(scores, index).tolist() == [3, 4, 8]
    assert dynamic_sampling_keep(scores, torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3])).tolist() == [3, 4, 8]
