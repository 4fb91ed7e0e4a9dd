"""The sampler's top-p cut of a row does not depend on the other rows of its batch.

At a real vocabulary (Qwen's 151936 tokens) ``sum`` over one long row alone is split across
threads while rows in a batch are not: about half of 64 rows get another last bit alone. A
top-p threshold right at a token's preceding mass would then keep the token in one case and
drop it in the other. The test searches, for every row whose two sums differ, a top-p where a
``sum``-based cut would flip, and requires the sampler's cut to be the same alone and batched.
"""

from __future__ import annotations

import _seeds
import pytest
import torch

from hybridrl.rollout.layers.sampler import _truncate

VOCAB, RANK = 151936, 5


def _flipping_top_p(sorted_probs: torch.Tensor) -> dict[int, float]:
    """Row -> a top-p at which ``before[RANK] >= top_p * sum`` differs between the row's sum
    alone and its sum in the batch (rows whose sums agree have none)."""
    batched_total = sorted_probs.sum(dim=-1)
    before = (sorted_probs.cumsum(dim=-1) - sorted_probs)[:, RANK]  # as _truncate computes it
    eps = torch.finfo(torch.float32).eps
    found = {}
    for i in range(sorted_probs.shape[0]):
        alone_total = sorted_probs[i:i + 1].sum(dim=-1)[0]
        if alone_total == batched_total[i]:
            continue
        centre = before[i] / batched_total[i]
        for k in range(-400, 401):
            tp = centre + k * eps * centre
            if bool(before[i] >= tp * alone_total) != bool(before[i] >= tp * batched_total[i]):
                found[i] = float(tp)
                break
    return found


def test_top_p_cut_alone_equals_in_a_batch():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the hazard needs a row alone split across threads (this folder's tests run on 1)
    try:
        _check_cut()
    finally:
        torch.set_num_threads(threads)


def _check_cut() -> None:
    g = torch.Generator().manual_seed(_seeds.fresh_seed())
    sorted_probs = torch.log_softmax(torch.randn(64, VOCAB, generator=g) * 2, dim=-1).exp()
    sorted_probs = sorted_probs.sort(dim=-1, descending=True).values
    flips = _flipping_top_p(sorted_probs)
    if not flips:  # this machine's sum is the same alone and batched: no cut can move, nothing to check
        pytest.skip("no row sums alone otherwise than among 64 at 2 threads here")
    top_p = torch.ones(64, 1)
    for i, tp in flips.items():
        top_p[i, 0] = tp
    top_k = torch.full((64, 1), VOCAB)
    batched = _truncate(sorted_probs, top_k, top_p)
    for i in flips:
        alone = _truncate(sorted_probs[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])
        assert torch.equal(alone[0], batched[i]), f"row {i}, top_p {flips[i]!r}: the cut moved with the batch"
