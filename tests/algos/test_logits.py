import torch

from _algo_helpers import make_mask, rand
from hybridrl.algos import entropy_bonus, entropy_from_logits, logprobs_from_logits


def test_logprobs_and_entropy_vs_float64():
    gen = torch.Generator().manual_seed(0)
    logits = rand((2, 5, 11), gen, 3.0).float()
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    ref = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels).double(),
                               ref.gather(-1, labels[..., None])[..., 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy_from_logits(logits).double(), -(ref.exp() * ref).sum(-1), rtol=1e-5, atol=1e-5)
    assert logprobs_from_logits(logits.bfloat16(), labels).dtype == torch.float32


def test_entropy_bonus_is_agg_of_entropy():
    gen = torch.Generator().manual_seed(1)
    mask = make_mask(3, 6, gen)
    ent = rand((3, 6), gen).abs()
    torch.testing.assert_close(entropy_bonus(ent, mask), (ent * mask).sum() / mask.sum())
