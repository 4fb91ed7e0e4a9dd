import torch

from _algo_helpers import make_mask, perturb_outside, rand
from hybridrl.algos import compute_value_loss

F64 = dict(dtype=torch.float64)


def test_hand():
    values = torch.tensor([[1.0, 1.0, 1.0, 0.0]], **F64)  # old
    returns = torch.tensor([[2.0, 0.0, 1.1, 9.0]], **F64)
    vpreds = torch.tensor([[1.5, 1.5, 1.5, 3.0]], **F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]], **F64)
    loss, m = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.2)
    # clipped vpred = 1.2 everywhere: token0 max(.25, .64)=.64 (clipped), token1 max(2.25, 1.44)=2.25,
    # token2 max(.16, .01)=.16
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.64 + 2.25 + 0.16) / 3, **F64))
    torch.testing.assert_close(m["vf_clipfrac"], torch.tensor(1 / 3, **F64))
    loss.backward()
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 1.5, 0.4, 0.0]], **F64) / 3)
    unclipped, m2 = compute_value_loss(vpreds, returns, values, mask, cliprange_value=None)
    torch.testing.assert_close(unclipped, torch.tensor(0.5 * (0.25 + 2.25 + 0.16) / 3, **F64))


def test_masked_positions_and_grads():
    gen = torch.Generator().manual_seed(0)
    mask = make_mask(5, 7, gen)
    vp0, ret0, val0 = rand((5, 7), gen), rand((5, 7), gen), rand((5, 7), gen)
    vp, ret, val = (t.clone().requires_grad_(True) for t in (vp0, ret0, val0))
    loss, _ = compute_value_loss(vp, ret, val, mask, 0.3, "seq-mean-token-mean")
    loss.backward()
    assert ret.grad is None and val.grad is None and not vp.grad[~mask.bool()].any()
    p = lambda x: perturb_outside(x, mask, gen)  # noqa: E731
    loss2, _ = compute_value_loss(p(vp0), p(ret0), p(val0), mask, 0.3, "seq-mean-token-mean")
    torch.testing.assert_close(loss2, loss.detach())
