import math

import pytest
import torch

from _algo_helpers import make_mask, perturb_outside, rand
from hybridrl.algos import POLICY_LOSSES, ClipRange, LossAggregation, get_policy_loss

F64 = dict(dtype=torch.float64)


def _call(name, **kw):
    return get_policy_loss(name)(**kw)


def test_vanilla_hand():
    # ratios 1.5 (A > 0: clipped at 1.28), 0.5 (A < 0: clipped at 0.8), 5 (A < 0: dual clip c = 3)
    ratio = torch.tensor([[1.5, 0.5, 5.0, 1.0]], **F64)
    adv = torch.tensor([[1.0, -1.0, -2.0, 3.0]], **F64)
    mask = torch.tensor([[1, 1, 1, 0]], **F64)
    old = torch.full_like(ratio, -1.0)
    lp = (old + ratio.log()).requires_grad_(True)
    loss, m = _call("vanilla", old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
                    clip=ClipRange(low=0.2, high=0.28, c=3.0))
    # token 0: max(-1.5, -1.28) = -1.28 (clipped, no grad); token 1: max(0.5, 0.8) = 0.8 (clipped)
    # token 2: max(10, 2.56)=10 → dual clip min(10, 6)=6 (no grad)
    torch.testing.assert_close(loss, torch.tensor((-1.28 + 0.8 + 6.0) / 3, **F64))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(2 / 3, **F64))
    torch.testing.assert_close(m["pg_clipfrac_lower"], torch.tensor(1 / 3, **F64))
    torch.testing.assert_close(m["ppo_kl"], -torch.log(ratio[0, :3]).mean())
    torch.testing.assert_close(m["ratio_max"], torch.tensor(5.0, **F64))
    torch.testing.assert_close(m["ratio_min"], torch.tensor(0.5, **F64))
    loss.backward()
    assert not lp.grad.any()  # every token clipped
    # without dual clip token 2 contributes 10 and has gradient -A·r/3
    lp.grad = None
    loss, m = _call("vanilla", old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
                    clip=ClipRange(low=0.2, high=0.28, c=None))
    torch.testing.assert_close(loss, torch.tensor((-1.28 + 0.8 + 10.0) / 3, **F64))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0, 0, 10 / 3, 0]], **F64))


def _ref_vanilla(lp, old, adv, mask, lo, hi, c):
    out = torch.zeros_like(lp)
    for i, j in mask.nonzero().tolist():
        r = math.exp(lp[i, j] - old[i, j])
        a = adv[i, j].item()
        v = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
        if a < 0:
            v = min(v, -a * c)
        out[i, j] = v
    return out.sum() / mask.sum()


def _ref_gspo(lp, old, adv, mask, lo, hi):
    total = 0.0
    for i in range(mask.shape[0]):
        idx = mask[i].bool()
        if not idx.any():
            continue
        s = torch.exp((lp[i, idx] - old[i, idx]).mean())  # sequence-level ratio with its true gradient
        a = adv[i, idx]
        total = total + torch.maximum(-a * s, -a * s.clamp(1 - lo, 1 + hi)).mean()
    return total / (mask.sum(-1) > 0).sum()


def _batch(seed, B=6, L=9, scale=0.3, seq_adv=False):
    gen = torch.Generator().manual_seed(seed)
    mask = make_mask(B, L, gen)
    old = -rand((B, L), gen).abs() - 0.1
    lp = old + rand((B, L), gen, scale)
    adv = rand(B, gen)[:, None].expand(B, L).clone() if seq_adv else rand((B, L), gen)
    return gen, mask, old, lp, adv


def test_vanilla_matches_float64_reference_and_grad():
    _, mask, old, lp0, adv = _batch(0)
    lp = lp0.clone().requires_grad_(True)
    ref = lp0.clone().requires_grad_(True)
    loss, _ = _call("vanilla", old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
                    clip=ClipRange(low=0.1, high=0.15, c=1.5))
    torch.testing.assert_close(loss, _ref_vanilla(lp0, old, adv, mask, 0.1, 0.15, 1.5))
    # gradient against autograd of a direct formula
    r = torch.exp(ref - old)
    l = torch.maximum(-adv * r, -adv * r.clamp(0.9, 1.15))
    l = torch.where(adv < 0, torch.minimum(l, -adv * 1.5), l)
    ((l * mask).sum() / mask.sum()).backward()
    loss.backward()
    torch.testing.assert_close(lp.grad, ref.grad)


def test_gspo_matches_sequence_level_objective_and_its_gradient():
    _, mask, old, lp0, adv = _batch(1, scale=0.05, seq_adv=True)
    lp = lp0.clone().requires_grad_(True)
    ref = lp0.clone().requires_grad_(True)
    loss, m = _call("gspo", old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
                    clip=ClipRange(low=0.01, high=0.02), aggregation=LossAggregation(mode="seq-mean-token-mean"))
    ref_loss = _ref_gspo(ref, old, adv, mask, 0.01, 0.02)
    torch.testing.assert_close(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(lp.grad, ref.grad)
    assert 0 < m["pg_clipfrac"] < 1  # some sequences clipped, some not: both branches exercised


def test_gspo_hand():
    # one sequence of 2 tokens, log ratios 0.1 and 0.3 → s = e^{0.2}; A = 1, no clip (ε large)
    old = torch.tensor([[-1.0, -2.0]], **F64)
    lp = (old + torch.tensor([[0.1, 0.3]], **F64)).requires_grad_(True)
    loss, m = _call("gspo", old_log_prob=old, log_prob=lp, advantages=torch.ones(1, 2, **F64),
                    response_mask=torch.ones(1, 2, **F64), clip=ClipRange(low=0.5, high=0.5))
    torch.testing.assert_close(loss, -torch.tensor(math.exp(0.2), **F64))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.full((1, 2), -math.exp(0.2) / 2, **F64))
    torch.testing.assert_close(m["ratio_mean"], torch.tensor(math.exp(0.2), **F64))


def test_cispo_hand_gradient_is_clipped_weight_times_score():
    ratio = torch.tensor([[2.0, 0.5, 1.1]], **F64)
    adv = torch.tensor([[1.0, -2.0, 3.0]], **F64)
    old = torch.full_like(ratio, -1.5)
    lp = (old + ratio.log()).requires_grad_(True)
    loss, m = _call("cispo", old_log_prob=old, log_prob=lp, advantages=adv, response_mask=torch.ones_like(adv),
                    clip=ClipRange(low=1.0, high=0.28))
    w = torch.tensor([[1.28, 0.5, 1.1]], **F64)
    torch.testing.assert_close(loss, (-adv * w * lp.detach()).mean())
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv * w / 3)  # every token keeps a gradient
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(1 / 3, **F64))


def test_reinforce_hand():
    lp = torch.tensor([[-1.0, -2.0, -3.0]], **F64, requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, 2.0]], **F64)
    mask = torch.tensor([[1, 1, 0]], **F64)
    loss, _ = _call("reinforce", old_log_prob=lp.detach(), log_prob=lp, advantages=adv, response_mask=mask)
    torch.testing.assert_close(loss, torch.tensor(3.0, **F64))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -1.0, 0.0]], **F64))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masks_grads_and_weights(name):
    gen, mask, old, lp0, adv = _batch(2)
    weights = rand(mask.shape, gen).abs() + 0.5
    old_r, adv_r, w_r = (t.clone().requires_grad_(True) for t in (old, adv, weights))
    lp = lp0.clone().requires_grad_(True)
    kw = dict(response_mask=mask, clip=ClipRange(low=0.2, high=0.28), aggregation=LossAggregation(mode="token-mean"),
              some_future_option=1)
    loss, metrics = _call(name, old_log_prob=old_r, log_prob=lp, advantages=adv_r, rollout_is_weights=w_r, **kw)
    loss.backward()
    # gradient only into log_prob, only at masked-in positions
    assert old_r.grad is None and adv_r.grad is None and w_r.grad is None
    assert not lp.grad[~mask.bool()].any() and lp.grad[mask.bool()].abs().sum() > 0
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "ratio_mean", "ratio_max", "ratio_min"):
        assert metrics[key].ndim == 0 and not metrics[key].requires_grad
    # garbage outside the mask changes nothing
    p = lambda x: perturb_outside(x, mask, gen)  # noqa: E731
    loss2, metrics2 = _call(name, old_log_prob=p(old), log_prob=p(lp0), advantages=p(adv),
                            rollout_is_weights=p(weights), **kw)
    torch.testing.assert_close(loss2, loss.detach())
    for key in metrics:
        torch.testing.assert_close(metrics2[key], metrics[key])
    # weights multiply the per-token loss: all-ones weights = no weights
    base, _ = _call(name, old_log_prob=old, log_prob=lp0, advantages=adv, **kw)
    ones, _ = _call(name, old_log_prob=old, log_prob=lp0, advantages=adv, rollout_is_weights=torch.ones_like(mask),
                    **kw)
    torch.testing.assert_close(base, ones)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_is_weights_multiply_each_tokens_loss(name, mode):
    """The loss is linear in the per-token IS weights with each token's own loss as the
    coefficient: loss(w) == sum_t w_t * loss(e_t) (e_t: weight 1 on token t alone). Weights
    ignored, applied to the wrong token, squared or normalized away all break it."""
    gen, mask, old, lp, adv = _batch(4, B=3, L=4)
    kw = dict(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
              clip=ClipRange(low=0.2, high=0.28), aggregation=LossAggregation(mode=mode))
    weights = rand(mask.shape, gen).abs() + 0.1
    got, _ = _call(name, rollout_is_weights=weights, **kw)
    want = torch.zeros((), **F64)
    for t in mask.flatten().nonzero()[:, 0].tolist():
        one_hot = torch.zeros(mask.numel(), **F64)
        one_hot[t] = 1.0
        alone, _ = _call(name, rollout_is_weights=one_hot.view(mask.shape), **kw)
        want = want + weights.flatten()[t] * alone
    torch.testing.assert_close(got, want)
    unweighted, _ = _call(name, **kw)
    assert not torch.allclose(got, unweighted)


def test_vanilla_is_weights_by_hand():
    # ratios 1 (no clip): per-token loss -A; weights 2 and 0.5, token-mean over 2 tokens
    old = torch.tensor([[-1.0, -2.0]], **F64)
    adv = torch.tensor([[1.0, 3.0]], **F64)
    loss, _ = _call("vanilla", old_log_prob=old, log_prob=old.clone(), advantages=adv,
                    response_mask=torch.ones_like(old), rollout_is_weights=torch.tensor([[2.0, 0.5]], **F64))
    torch.testing.assert_close(loss, torch.tensor(-(2.0 * 1.0 + 0.5 * 3.0) / 2, **F64))


def test_on_policy_losses_agree_at_ratio_one():
    """At π_θ = π_old, PPO/CISPO/REINFORCE have the same gradient (-A ∇log π)."""
    _, mask, old, _, adv = _batch(3)
    grads = {}
    for name in ("vanilla", "cispo", "reinforce"):
        lp = old.clone().requires_grad_(True)
        _call(name, old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask)[0].backward()
        grads[name] = lp.grad
    torch.testing.assert_close(grads["vanilla"], grads["reinforce"])
    torch.testing.assert_close(grads["cispo"], grads["reinforce"])


def test_unknown_loss_and_bad_c():
    with pytest.raises(ValueError, match="did you mean 'gspo'"):
        get_policy_loss("gpso")
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        _call("vanilla", old_log_prob=x, log_prob=x, advantages=x, response_mask=torch.ones(1, 2),
              clip=ClipRange(c=0.5))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_flat_clip_and_aggregation_keywords_are_refused(name):
    """The keywords ClipRange / LossAggregation replaced would be swallowed by **kwargs."""
    x = torch.zeros(1, 2)
    with pytest.raises(TypeError, match=r"clip_ratio_low.*ClipRange"):
        _call(name, old_log_prob=x, log_prob=x, advantages=x, response_mask=torch.ones(1, 2), clip_ratio_low=0.1)
    with pytest.raises(TypeError, match=r"loss_agg_mode.*LossAggregation"):
        _call(name, old_log_prob=x, log_prob=x, advantages=x, response_mask=torch.ones(1, 2),
              loss_agg_mode="token-sum")
