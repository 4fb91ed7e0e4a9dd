import math

import pytest
import torch

from _algo_helpers import make_mask, perturb_outside, rand
from hybridrl.algos import compute_seq_mismatch_mask, compute_tis_weights

F64 = dict(dtype=torch.float64)


def test_tis_hand():
    old = torch.tensor([[-1.0, -1.0, -1.0, 0.0]], **F64, requires_grad=True)
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -7.0]], **F64)
    mask = torch.tensor([[1, 1, 1, 0]], **F64)
    w, m = compute_tis_weights(old, rollout, mask, tis_cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, math.exp(-0.5), 0.0]], **F64))  # e^1 capped at 2
    assert not w.requires_grad
    torch.testing.assert_close(m["tis_ratio_mean"], torch.tensor((1 + math.e + math.exp(-0.5)) / 3, **F64))
    torch.testing.assert_close(m["tis_capped_frac"], torch.tensor(1 / 3, **F64))
    with pytest.raises(ValueError, match="tis_cap"):
        compute_tis_weights(old, rollout, mask, tis_cap=0.0)


def test_seq_mask_hand():
    old = torch.zeros(3, 3, **F64)
    rollout = torch.tensor([[-0.1, 0.1, 0.0], [-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]], **F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], **F64)
    # geometric means: e^0 = 1 (keep), e^{2/3} ≈ 1.95 (masked with upper 1.5), empty row stays empty
    new_mask, m = compute_seq_mismatch_mask(old, rollout, mask, upper=1.5)
    torch.testing.assert_close(new_mask, torch.tensor([[1, 1, 0], [0, 0, 0], [0, 0, 0]], **F64))
    torch.testing.assert_close(m["mismatch_masked_frac"], torch.tensor(0.5, **F64))
    torch.testing.assert_close(m["mismatch_seq_ratio_mean"], torch.tensor((1 + math.exp(2 / 3)) / 2, **F64))
    with pytest.raises(ValueError, match="lower"):
        compute_seq_mismatch_mask(old, rollout, mask, upper=1.5, lower=1.2)


def test_random_vs_reference_and_masked_positions():
    gen = torch.Generator().manual_seed(0)
    mask = make_mask(8, 9, gen)
    old, roll = -rand((8, 9), gen).abs(), -rand((8, 9), gen).abs()
    w, _ = compute_tis_weights(old, roll, mask, tis_cap=1.5)
    torch.testing.assert_close(w, torch.clamp(torch.exp(old - roll), max=1.5) * mask)
    new_mask, _ = compute_seq_mismatch_mask(old, roll, mask, upper=1.3, lower=0.6)
    for b in range(8):
        idx = mask[b].bool()
        rho = math.exp((old[b, idx] - roll[b, idx]).mean())
        assert bool(new_mask[b].any()) == (0.6 <= rho <= 1.3)
    p = lambda x: perturb_outside(x, mask, gen)  # noqa: E731
    assert torch.equal(compute_tis_weights(p(old), p(roll), mask, tis_cap=1.5)[0], w)
    assert torch.equal(compute_seq_mismatch_mask(p(old), p(roll), mask, upper=1.3, lower=0.6)[0], new_mask)
