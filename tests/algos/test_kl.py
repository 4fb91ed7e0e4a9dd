import math

import pytest
import torch

from _algo_helpers import make_mask, perturb_outside, rand
from hybridrl.algos import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController, apply_kl_penalty,
                            compute_kl_loss, kl_penalty)

F64 = dict(dtype=torch.float64)


def test_estimators_hand():
    lp = torch.tensor([-1.0, -2.0, -1.0, 0.0], **F64)
    ref = torch.tensor([-1.5, -1.0, -1.0, -40.0], **F64)
    d = lp - ref  # 0.5, -1, 0, 40
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), d)
    torch.testing.assert_close(kl_penalty(lp, ref, "kl"), d)
    torch.testing.assert_close(kl_penalty(lp, ref, "abs"), d.abs())
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), 0.5 * d ** 2)
    torch.testing.assert_close(kl_penalty(lp, ref, "mse"), 0.5 * d ** 2)
    k3 = torch.tensor([math.exp(-0.5) + 0.5 - 1, math.exp(1) - 1 - 1, 0.0,
                       10.0], **F64)  # last: exp(-20)+20-1 = 19 → clamped to 10 (inner clamp at 20)
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), k3)
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), k3)


def test_k1_k3_are_unbiased_estimates_of_kl():
    """Sample from a categorical π, average the estimators: ≈ exact KL(π‖π_ref) (float64)."""
    gen = torch.Generator().manual_seed(0)
    logits_p, logits_q = rand(6, gen), rand(6, gen)
    logp, logq = logits_p.log_softmax(-1), logits_q.log_softmax(-1)
    exact = (logp.exp() * (logp - logq)).sum()
    y = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=gen)
    for kind in ("k1", "k3"):
        est = kl_penalty(logp[y], logq[y], kind).mean()
        assert abs(est - exact) < 0.02 * max(1.0, exact.item()), (kind, est, exact)


def test_unknown_kind():
    with pytest.raises(ValueError, match="did you mean 'low_var_kl'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "low_var")


@pytest.mark.parametrize("kind", KL_ESTIMATORS)
def test_kl_loss_masks_and_grad(kind):
    gen = torch.Generator().manual_seed(1)
    mask = make_mask(4, 6, gen)
    lp0, ref0 = -rand((4, 6), gen).abs(), -rand((4, 6), gen).abs()
    lp, ref = lp0.clone().requires_grad_(True), ref0.clone().requires_grad_(True)
    loss, m = compute_kl_loss(log_prob=lp, ref_log_prob=ref, response_mask=mask, kind=kind)
    torch.testing.assert_close(loss, (kl_penalty(lp0, ref0, kind) * mask).sum() / mask.sum())
    loss.backward()
    assert ref.grad is None and not lp.grad[~mask.bool()].any()
    loss2, _ = compute_kl_loss(log_prob=perturb_outside(lp0, mask, gen), ref_log_prob=perturb_outside(ref0, mask, gen),
                               response_mask=mask, kind=kind)
    torch.testing.assert_close(loss2, loss.detach())


def test_apply_kl_penalty_fixed():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], **F64)
    mask = torch.tensor([[0, 1, 1, 0]], **F64)
    old = torch.tensor([[-1.0, -1.0, -2.0, -3.0]], **F64)
    ref = torch.tensor([[-9.0, -1.5, -1.0, -1.0]], **F64)
    ctrl = FixedKLController(kl_coef=0.1)
    out, m = apply_kl_penalty(token_level_rewards=rewards, old_log_prob=old, ref_log_prob=ref, response_mask=mask,
                              kl_ctrl=ctrl, kind="k1")
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.05, 1.1, 0.0]], **F64))
    torch.testing.assert_close(m["kl_penalty"], torch.tensor(-0.25, **F64))
    assert ctrl.value == 0.1


def test_adaptive_controller_ziegler():
    ctrl = AdaptiveKLController(kl_coef=0.2, target_kl=1.0, horizon=100)
    ctrl.update(current_kl=1.1, n_steps=10)  # error 0.1 → ×1.01
    assert math.isclose(ctrl.value, 0.2 * 1.01)
    ctrl.update(current_kl=5.0, n_steps=10)  # error clipped to 0.2 → ×1.02
    assert math.isclose(ctrl.value, 0.2 * 1.01 * 1.02)
    ctrl.update(current_kl=0.0, n_steps=50)  # error -0.2 → ×0.9
    assert math.isclose(ctrl.value, 0.2 * 1.01 * 1.02 * 0.9)
    # through apply_kl_penalty: n_steps = batch size
    ctrl = AdaptiveKLController(kl_coef=0.5, target_kl=0.1, horizon=40)
    mask = torch.ones(4, 3, **F64)
    apply_kl_penalty(token_level_rewards=torch.zeros(4, 3, **F64), old_log_prob=torch.zeros(4, 3, **F64),
                     ref_log_prob=torch.full((4, 3), -1.0, **F64), response_mask=mask, kl_ctrl=ctrl)
    assert math.isclose(ctrl.value, 0.5 * (1 + 0.2 * 4 / 40))
