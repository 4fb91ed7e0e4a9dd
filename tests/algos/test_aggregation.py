import pytest
import torch

from _algo_helpers import make_mask, rand
from hybridrl.algos import (LOSS_AGG_MODES, POLICY_LOSSES, ClipRange, GlobalBatchInfo, LossAggregation, agg_loss,
                            get_policy_loss)

C = 16.0  # Dr. GRPO constant (max response length)


def test_hand_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    expect = {"token-mean": 7 / 3, "token-sum": 7.0, "seq-mean-token-sum": 7 / 2,
              "seq-mean-token-mean": (1.5 + 4) / 2, "seq-mean-token-sum-norm": 7 / (2 * C)}
    for mode, value in expect.items():
        torch.testing.assert_close(agg_loss(loss, mask, mode, loss_scale_factor=C),
                                   torch.tensor(value, dtype=torch.float64))


def test_empty_rows_do_not_count_and_empty_mask_is_zero():
    loss = torch.tensor([[1.0, 2.0], [9.0, 9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.float64)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == 3.0
    zero = agg_loss(loss, torch.zeros_like(mask), "token-mean")
    zero.backward()
    assert zero.item() == 0.0 and not loss.grad.any()


def test_masked_positions_never_matter_even_nan():
    gen = torch.Generator().manual_seed(0)
    mask = make_mask(5, 8, gen)
    loss = rand((5, 8), gen)
    nan_outside = torch.where(mask.bool(), loss, torch.nan)
    for mode in LOSS_AGG_MODES:
        assert torch.equal(agg_loss(loss, mask, mode, loss_scale_factor=C),
                           agg_loss(nan_outside, mask, mode, loss_scale_factor=C))


def test_errors():
    x, m = torch.ones(2, 2), torch.ones(2, 2)
    with pytest.raises(ValueError, match="did you mean 'token-mean'"):
        agg_loss(x, m, "token_mean")
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(x, m, "seq-mean-token-sum-norm")


def _loss_fn(name):
    if name == "agg":
        return lambda lp, old, adv, m, mode, info: agg_loss((lp * adv).square(), m, mode, global_batch_info=info,
                                                            loss_scale_factor=C)
    fn = get_policy_loss(name)
    return lambda lp, old, adv, m, mode, info: fn(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=m, clip=ClipRange(low=0.2, high=0.28),
        aggregation=LossAggregation(mode=mode, global_batch_info=info, loss_scale_factor=C))[0]


@pytest.mark.parametrize("name", ["agg", *sorted(POLICY_LOSSES)])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_and_ranks_give_the_big_batch_gradient(name, mode):
    """One mini-batch of 12 rows vs (a) 3 uneven micro-batches summed, (b) 2 simulated DP ranks
    × 2 micro-batches each, gradients averaged over ranks as DDP does: same gradient."""
    gen = torch.Generator().manual_seed(5)
    B, L = 12, 10
    mask = make_mask(B, L, gen)
    mask[4] = 0  # an empty row must count nowhere
    old = -rand((B, L), gen).abs()
    lp0 = old + rand((B, L), gen, 0.3)
    adv = rand((B, L), gen)
    fn = _loss_fn(name)

    lp = lp0.clone().requires_grad_(True)
    fn(lp, old, adv, mask, mode, None).backward()
    ref_grad = lp.grad.clone()
    assert ref_grad.abs().sum() > 0

    def run(splits_per_rank):
        ranks = len(splits_per_rank)
        all_parts = [rows for rank in splits_per_rank for rows in rank]
        info = GlobalBatchInfo.from_masks([mask[rows] for rows in all_parts])
        info = GlobalBatchInfo(global_tokens=info.global_tokens, global_seqs=info.global_seqs, dp_size=ranks)
        grad = torch.zeros_like(lp0)
        for rank in splits_per_rank:
            lp = lp0.clone().requires_grad_(True)  # this rank's replica
            for rows in rank:
                fn(lp[rows], old[rows], adv[rows], mask[rows], mode, info).backward()
            grad += lp.grad / ranks  # DDP all-reduce: average over ranks
        return grad

    r = torch.arange(B)
    torch.testing.assert_close(run([[r[:2], r[2:9], r[9:]]]), ref_grad)
    torch.testing.assert_close(run([[r[:3], r[3:5]], [r[5:11], r[11:]]]), ref_grad)


def test_from_masks_counts():
    m1 = torch.tensor([[1, 1, 0], [0, 0, 0]])
    m2 = torch.tensor([[0, 1, 1]])
    info = GlobalBatchInfo.from_masks([m1, m2])
    assert (info.global_tokens, info.global_seqs, info.dp_size) == (4.0, 2.0, 1)
