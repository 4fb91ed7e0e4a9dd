import math

import pytest
import torch

from _algo_helpers import last_token_rewards, make_mask, perturb_outside, rand
from hybridrl.algos import ADV_ESTIMATORS, get_adv_estimator, masked_whiten, scores_to_token_level_rewards

OUTCOME = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"]


def _hand_batch():
    # 4 rows, L=5: prompt 2 tokens, responses of 3, 2, 3, 1 tokens; groups a,a,a,b? -> use a,a,b,b
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.float64)
    scores = torch.tensor([1.0, 0.0, 2.0, 4.0], dtype=torch.float64)
    return mask, last_token_rewards(scores, mask), ["a", "a", "b", "b"]


def test_scores_to_token_level_rewards():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    out = scores_to_token_level_rewards(torch.tensor([2.0, 3.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[0, 0, 2.0, 0], [0, 0, 0, 0], [0, 0, 0, -1.0]]))


def test_grpo_hand():
    mask, rewards, index = _hand_batch()
    adv, ret = get_adv_estimator("grpo")(token_level_rewards=rewards, response_mask=mask, index=index)
    # group a: scores 1, 0 → mean .5, unbiased std sqrt(.5); group b: 2, 4 → mean 3, std sqrt(2)
    expect = torch.tensor([0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6),
                           -1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)], dtype=torch.float64)
    torch.testing.assert_close(adv, expect[:, None] * mask)
    assert torch.equal(adv, ret)
    dr, _ = get_adv_estimator("dr_grpo")(token_level_rewards=rewards, response_mask=mask, index=index)
    torch.testing.assert_close(dr, torch.tensor([0.5, -0.5, -1.0, 1.0], dtype=torch.float64)[:, None] * mask)
    nostd, _ = get_adv_estimator("grpo")(token_level_rewards=rewards, response_mask=mask, index=index,
                                         norm_adv_by_std_in_grpo=False)
    assert torch.equal(nostd, dr)


def test_singleton_groups_get_the_raw_score():
    mask, rewards, _ = _hand_batch()
    for name, scale in (("grpo", 1 / (1 + 1e-6)), ("dr_grpo", 1.0), ("rloo", 1.0)):
        adv, _ = get_adv_estimator(name)(token_level_rewards=rewards, response_mask=mask, index=[0, 1, 2, 3])
        expect = torch.tensor([1.0, 0.0, 2.0, 4.0], dtype=torch.float64)[:, None] * mask * scale
        torch.testing.assert_close(adv, expect, rtol=1e-12, atol=1e-12)


def test_rloo_hand():
    mask = torch.ones(3, 2, dtype=torch.float64)
    rewards = last_token_rewards(torch.tensor([3.0, 0.0, 6.0], dtype=torch.float64), mask)
    adv, _ = get_adv_estimator("rloo")(token_level_rewards=rewards, response_mask=mask, index=torch.tensor([7, 7, 7]))
    # leave-one-out baselines: (0+6)/2=3, (3+6)/2=4.5, (3+0)/2=1.5
    torch.testing.assert_close(adv, torch.tensor([0.0, -4.5, 4.5], dtype=torch.float64)[:, None] * mask)


def test_remax_hand():
    mask, rewards, _ = _hand_batch()
    adv, ret = get_adv_estimator("remax")(token_level_rewards=rewards, response_mask=mask,
                                          reward_baselines=torch.tensor([0.5, 0.5, 1.0, 1.0]))
    torch.testing.assert_close(ret, torch.tensor([1.0, 0.0, 2.0, 4.0], dtype=torch.float64)[:, None] * mask)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 1.0, 3.0], dtype=torch.float64)[:, None] * mask)


def test_reinforce_pp_hand():
    mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.float64)
    rewards = torch.tensor([[9.0, 1.0, 0.0, 2.0]], dtype=torch.float64)  # the 9 is outside the mask
    adv, ret = get_adv_estimator("reinforce_plus_plus")(token_level_rewards=rewards, response_mask=mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0, 1 + 0.5 * 0.0 + 0.25 * 2, 1.0, 2.0]], dtype=torch.float64))
    g = torch.tensor([1.5, 1.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(adv[0, 1:], (g - g.mean()) / torch.sqrt(g.var() + 1e-8))


def test_gae_hand():
    # one row, response tokens at 1..2, γ=0.9, λ=0.5
    mask = torch.tensor([[0, 1, 1, 0]], dtype=torch.float64)
    rewards = torch.tensor([[0, 0, 1.0, 0]], dtype=torch.float64)
    values = torch.tensor([[5.0, 0.5, 0.2, 7.0]], dtype=torch.float64)
    adv, ret = get_adv_estimator("gae")(token_level_rewards=rewards, response_mask=mask, values=values,
                                        gamma=0.9, lam=0.5)
    d2 = 1.0 - 0.2
    d1 = 0.0 + 0.9 * 0.2 - 0.5
    a2, a1 = d2, d1 + 0.9 * 0.5 * d2
    torch.testing.assert_close(ret, torch.tensor([[0, a1 + 0.5, a2 + 0.2, 0]], dtype=torch.float64))
    a = torch.tensor([a1, a2], dtype=torch.float64)
    torch.testing.assert_close(adv[0, 1:3], (a - a.mean()) / torch.sqrt(a.var() + 1e-8))


def _ref_outcome(name, scores, mask, index):
    """float64 loop reference of the outcome estimators."""
    out = torch.zeros(len(scores), dtype=torch.float64)
    for i in range(len(scores)):
        grp = torch.tensor([scores[j] for j in range(len(scores)) if index[j] == index[i]], dtype=torch.float64)
        n = len(grp)
        if name == "grpo":
            out[i] = scores[i] / (1 + 1e-6) if n == 1 else (scores[i] - grp.mean()) / (grp.std() + 1e-6)
        elif name == "dr_grpo":
            out[i] = scores[i] if n == 1 else scores[i] - grp.mean()
        elif name == "rloo":
            out[i] = scores[i] if n == 1 else scores[i] - (grp.sum() - scores[i]) / (n - 1)
        else:
            out[i] = scores[i] - (grp.mean() if n > 1 else 0.0)
    tok = out[:, None] * mask
    if name == "reinforce_plus_plus_baseline":
        vals = tok[mask.bool()]
        tok = (tok - vals.mean()) / torch.sqrt(vals.var() + 1e-8) * mask
    return tok


def _ref_gae(rewards, values, mask, gamma, lam):
    B, L = mask.shape
    adv, ret = torch.zeros(B, L, dtype=torch.float64), torch.zeros(B, L, dtype=torch.float64)
    for b in range(B):
        pos = mask[b].nonzero()[:, 0].tolist()
        last, nxt = 0.0, 0.0
        for t in reversed(pos):
            last = rewards[b, t] + gamma * nxt - values[b, t] + gamma * lam * last
            nxt = values[b, t]
            adv[b, t], ret[b, t] = last, last + values[b, t]
    vals = adv[mask.bool()]
    return (adv - vals.mean()) / torch.sqrt(vals.var() + 1e-8) * mask, ret


@pytest.mark.parametrize("name", OUTCOME)
def test_outcome_estimators_match_float64_reference(name):
    gen = torch.Generator().manual_seed(1)
    B, L = 12, 9
    mask = make_mask(B, L, gen)
    scores = rand(B, gen)
    index = [i // 4 for i in range(B - 2)] + [100, 101]  # groups of 4, 4, 2 + two singletons
    adv, ret = get_adv_estimator(name)(token_level_rewards=last_token_rewards(scores, mask), response_mask=mask,
                                       index=index)
    torch.testing.assert_close(adv, _ref_outcome(name, scores, mask, index))
    assert torch.equal(adv, ret)


def test_gae_and_reinforce_pp_match_float64_reference():
    gen = torch.Generator().manual_seed(2)
    B, L = 6, 10
    mask = make_mask(B, L, gen)
    rewards, values = rand((B, L), gen) * mask, rand((B, L), gen)
    adv, ret = get_adv_estimator("gae")(token_level_rewards=rewards, response_mask=mask, values=values,
                                        gamma=0.95, lam=0.9)
    ref_adv, ref_ret = _ref_gae(rewards, values, mask, 0.95, 0.9)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    # REINFORCE++ = GAE with V ≡ 0 and λ = 1 (returns = discounted return-to-go)
    adv2, ret2 = get_adv_estimator("reinforce_plus_plus")(token_level_rewards=rewards, response_mask=mask, gamma=0.95)
    ref_adv2, ref_ret2 = _ref_gae(rewards, torch.zeros_like(values), mask, 0.95, 1.0)
    torch.testing.assert_close(ret2, ref_ret2)
    torch.testing.assert_close(adv2, ref_adv2)


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATORS))
def test_masked_positions_never_matter(name):
    gen = torch.Generator().manual_seed(3)
    B, L = 8, 7
    mask = make_mask(B, L, gen)
    rewards = last_token_rewards(rand(B, gen), mask)
    kwargs = dict(index=[0, 0, 0, 1, 1, 1, 2, 2], values=rand((B, L), gen), reward_baselines=rand(B, gen),
                  gamma=0.9, lam=0.95, unknown_key_is_ignored=True)
    fn = get_adv_estimator(name)
    adv, ret = fn(token_level_rewards=rewards, response_mask=mask, **kwargs)
    kwargs["values"] = perturb_outside(kwargs["values"], mask, gen)
    adv2, ret2 = fn(token_level_rewards=perturb_outside(rewards, mask, gen), response_mask=mask, **kwargs)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert not adv[~mask.bool()].any() and not ret[~mask.bool()].any()
    assert adv[mask.bool()].abs().sum() > 0


def test_response_only_layout_gives_the_same_advantages():
    gen = torch.Generator().manual_seed(4)
    B, L, P = 6, 8, 3
    full = torch.zeros(B, L, dtype=torch.float64)
    lengths = [5, 3, 4, 1, 5, 2]
    for b, r in enumerate(lengths):
        full[b, P:P + r] = 1
    rewards, values = last_token_rewards(rand(B, gen), full), rand((B, L), gen)
    kw = dict(index=[0, 0, 0, 1, 1, 1], gamma=0.9, lam=0.8)
    for name in ("grpo", "gae", "reinforce_plus_plus"):
        a_full, _ = get_adv_estimator(name)(token_level_rewards=rewards, response_mask=full, values=values, **kw)
        a_resp, _ = get_adv_estimator(name)(token_level_rewards=rewards[:, P:], response_mask=full[:, P:],
                                            values=values[:, P:], **kw)
        torch.testing.assert_close(a_full[:, P:], a_resp)


def test_index_as_tensor_or_list_is_the_same():
    mask, rewards, _ = _hand_batch()
    a, _ = get_adv_estimator("grpo")(token_level_rewards=rewards, response_mask=mask, index=["x", "x", "y", "y"])
    b, _ = get_adv_estimator("grpo")(token_level_rewards=rewards, response_mask=mask, index=torch.tensor([5, 5, 2, 2]))
    assert torch.equal(a, b)


def test_errors_are_one_line_and_helpful():
    with pytest.raises(ValueError, match="did you mean 'rloo'"):
        get_adv_estimator("rlooo")
    mask, rewards, _ = _hand_batch()
    with pytest.raises(ValueError, match="needs `index`"):
        get_adv_estimator("grpo")(token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="values"):
        get_adv_estimator("gae")(token_level_rewards=rewards, response_mask=mask)
    assert get_adv_estimator("gae").requires == ("values",)
    assert get_adv_estimator("remax").requires == ("reward_baselines",)


def test_masked_whiten_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1, 0]], dtype=torch.float64)
    torch.testing.assert_close(masked_whiten(x, m), torch.tensor([[-1.0, 0.0, 1.0, 0.0]], dtype=torch.float64) /
                               math.sqrt(1 + 1e-8))
