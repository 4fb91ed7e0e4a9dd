"""DeepSeek-V4's indexer selection rule (``hybridrl/rollout/models/deepseek_v4/selection.py``): the
highest scores, ties to the most recent entry, never dependent on the row's length."""
import torch

from hybridrl.rollout.models.deepseek_v4.selection import ordered_score_keys, select_top_entries
from tests.rollout._deepseek import fresh_seed


def test_ties_go_to_the_most_recent_entry_by_hand():
    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, -0.0, 1.0]])  # complete: all 6
    ids = select_top_entries(scores, torch.tensor([6]), 3)
    assert sorted(ids[0].tolist()) == [1, 4, 5]  # 2.0, 1.0, then the newest of the zeros (-0.0 == 0.0)
    ids = select_top_entries(scores, torch.tensor([4]), 3)  # only entries 0-3 complete
    assert sorted(ids[0].tolist()) == [1, 2, 3]
    ids = select_top_entries(scores, torch.tensor([2]), 3)  # fewer complete than k: -1 for the rest
    assert sorted(ids[0].tolist()) == [-1, 0, 1]
    assert select_top_entries(scores[:, :0], torch.tensor([0]), 3).shape == (1, 0)


def test_the_choice_does_not_depend_on_entries_past_the_complete_ones():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    scores = torch.relu(torch.randn(64, 20, generator=g)).round(decimals=1)  # many exact ties
    complete = torch.randint(0, 21, (64,), generator=g)
    want = select_top_entries(scores, complete, 4).sort(-1).values
    for extra in (1, 7, 100):  # longer rows: future entries (any value) and padding
        longer = torch.cat([scores, 5 * torch.rand(64, extra, generator=g)], dim=-1)
        got = select_top_entries(longer, complete, 4).sort(-1).values
        assert torch.equal(got, want), f"seed {seed} extra {extra}"


def test_distinct_scores_pick_what_topk_picks_and_keys_keep_the_float_order():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(32, 50, generator=g) * torch.logspace(-30, 30, 50)  # distinct, every magnitude
    complete = torch.full((32,), 50)
    got = select_top_entries(scores, complete, 5).sort(-1).values
    assert torch.equal(got, scores.topk(5, dim=-1).indices.sort(-1).values), f"seed {seed}"
    flat = torch.cat([scores.flatten(), torch.tensor([float("inf"), float("-inf"), 0.0, -0.0])])
    by_key = flat[ordered_score_keys(flat).sort().indices]
    assert torch.equal(by_key, flat.sort().values), f"seed {seed}"
